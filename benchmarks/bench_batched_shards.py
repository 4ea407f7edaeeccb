"""A probe for issue 51: the reproducible mode's shards batched into one pass with ``torch.func.vmap``.

The mode runs each rank's ``V / N`` shards of ``G / V`` rows as sequential passes, and at 32 rows a shard
that costs about 2x the default mode's one pass (docs/benchmarks.md). This measures, in one process on one
CPU thread, for MLPs of about 300k and 3M parameters:

- whether per-shard gradients from one ``vmap(grad(loss))`` over the shards have bits independent of how
  the shards are grouped (every split of V shards into consecutive groups, as N ranks would hold them), the
  property the mode needs to give the same bits on any number of ranks; and whether they equal the
  sequential passes' bits (they need not: every N would take the batched path);
- the time per step of a rank's shards: sequential passes, one ``vmap``, and one pass over all their rows
  (the default mode's step, the anchor), interleaved over ``--rounds`` rounds, printed as ratios.

It is a probe of the design, not of the mode: the mode itself still runs sequential shards.

    .venv/bin/python benchmarks/bench_batched_shards.py [--rounds 5] [--shards 8] [--rows 32 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.func import functional_call, grad, vmap

MODELS = {"mlp-300k": 512, "mlp-3M": 1700}  # the hidden width of a 64-h-h-10 MLP (bench_reproducible.py's)


def _splits(shards: int) -> list[list[int]]:
    """Every way N = 1..shards ranks hold the shards in consecutive groups as even as possible."""
    out = []
    for ranks in range(1, shards + 1):
        base, extra = divmod(shards, ranks)
        out.append([base + (1 if r < extra else 0) for r in range(ranks)])
    return out


def _probe(width: int, shards: int, rows: int, rounds: int) -> dict[str, float | bool]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )  # fmt: skip
    params = {name: p.detach() for name, p in net.named_parameters()}
    x, y = torch.randn(shards, rows, 64), torch.randint(0, 10, (shards, rows))

    def loss(p: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(functional_call(net, p, (xb,)), yb, reduction="sum")

    per_shard = grad(loss)
    batched = vmap(per_shard, in_dims=(None, 0, 0))

    def sequential(first: int, count: int) -> list[dict[str, torch.Tensor]]:
        return [per_shard(params, x[i], y[i]) for i in range(first, first + count)]

    def in_one_vmap(first: int, count: int) -> list[dict[str, torch.Tensor]]:
        out = batched(params, x[first : first + count], y[first : first + count])
        return [{name: value[j] for name, value in out.items()} for j in range(count)]

    def equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
        return all(torch.equal(u[name], v[name]) for u, v in zip(a, b, strict=True) for name in params)

    whole = in_one_vmap(0, shards)
    grouped = []
    for split in _splits(shards):
        got, first = [], 0
        for count in split:
            got += in_one_vmap(first, count)
            first += count
        grouped.append(equal(got, whole))
    # a rank of 2's share of the shards, as the mode would run it on 2 ranks
    share = max(1, shards // 2)
    one_pass = lambda: grad(loss)(params, x[:share].reshape(-1, 64), y[:share].reshape(-1))  # noqa: E731
    variants: dict[str, Callable[[], object]] = {
        "one pass": one_pass,
        "sequential": lambda: sequential(0, share),
        "vmap": lambda: in_one_vmap(0, share),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():  # interleaved: the machine's drift hits every variant alike
            run()
            start = time.perf_counter()
            for _ in range(10):
                run()
            times[name].append((time.perf_counter() - start) / 10 * 1e3)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "grouping-independent": all(grouped),
        "equal to sequential": equal(whole, sequential(0, shards)),
        **{f"{name} ms": value for name, value in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 5])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the mode pins one per rank
    print(f"torch {torch.__version__}, 1 thread, V = {args.shards} shards, a rank's share: {max(1, args.shards // 2)}")
    print("| model | rows a shard | bits independent of grouping | equal to sequential passes |"
          " one pass ms | sequential ms | vmap ms | sequential / one pass | vmap / one pass |")  # fmt: skip
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for model, width in MODELS.items():
        for rows in args.rows:
            r = _probe(width, args.shards, rows, args.rounds)
            one, seq, vm = r["one pass ms"], r["sequential ms"], r["vmap ms"]
            print(
                f"| {model} | {rows} | {r['grouping-independent']} | {r['equal to sequential']} | {one:.2f} |"
                f" {seq:.2f} | {vm:.2f} | {seq / one:.2f}x | {vm / one:.2f}x |"
            )


if __name__ == "__main__":
    main()
