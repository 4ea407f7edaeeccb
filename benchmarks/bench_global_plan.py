"""Step time of exact epochs against Lightning's DistributedSampler path, on 2 CPU ranks.

Four fits of one MLP (batch 64 rows per step over 2 ranks) alternate in one run, ``REPEATS`` times:

* anchor: ``DDPPluginsStrategy()`` with Lightning's ``DistributedSampler`` (32 rows per rank);
* global plan: ``DDPPluginsStrategy(global_batch_size=64)`` (the loss weighted by rows each step);
* per-rank shards with ``uneven_data=False`` (each rank iterates its own ``IterableDataset``);
* the same shards with ``uneven_data=True`` (the default: ``EvenSteps``, one small all-reduce per step).

The median time between consecutive ``on_train_batch_end`` of each variant is compared.

    .venv/bin/python benchmarks/bench_global_plan.py
"""

import logging
import os
import statistics
import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from ddp_plugins.core import run_main
from ddp_plugins.lightning import DDPPluginsStrategy
from ddp_plugins.testing import LOOPBACK_ENV

ROWS = 64 * 40  # 40 steps of 64 rows
WIDTH = 512
REPEATS = 3


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randint(10, (ROWS,), generator=g)


class _Shards(IterableDataset):
    def __iter__(self):
        x, y = _data()
        rank, world = dist.get_rank(), dist.get_world_size()
        for i in range(rank, ROWS, world):
            yield x[i], y[i]


class _Net(pl.LightningModule):
    def __init__(self, loader) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
        self.loader = loader
        self.ends: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return self.loader()


VARIANTS = {
    "DistributedSampler (anchor)": ({}, lambda: DataLoader(TensorDataset(*_data()), batch_size=32, shuffle=True)),
    "global plan, G=64": (
        {"global_batch_size": 64},
        lambda: DataLoader(TensorDataset(*_data()), batch_size=32, shuffle=True),
    ),
    "per-rank shards, uneven_data=False": ({"uneven_data": False}, lambda: DataLoader(_Shards(), batch_size=32)),
    "per-rank shards, EvenSteps": ({}, lambda: DataLoader(_Shards(), batch_size=32)),
}


def _fit(kwargs, loader) -> list[float]:
    model = _Net(loader)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPPluginsStrategy(backend="gloo", **kwargs),
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    ends = model.ends[5:]  # the first steps warm up
    return [b - a for a, b in zip(ends, ends[1:], strict=False)]


def main() -> None:
    os.environ.update(LOOPBACK_ENV)  # gloo over loopback, one thread per rank; the child rank inherits it
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(REPEATS):
        for name, (kwargs, loader) in VARIANTS.items():
            times[name] += _fit(kwargs, loader)
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    anchor = medians["DistributedSampler (anchor)"]
    shards = medians["per-rank shards, uneven_data=False"]
    print(f"\n{WIDTH}-wide MLP, 64 rows per step on 2 CPU ranks (gloo), median of {len(times[name])} steps each\n")
    print("| variant | ms / step | ratio |")
    print("|---|---:|---:|")
    for name, ms in medians.items():
        base = shards if name == "per-rank shards, EvenSteps" else anchor
        print(f"| {name} | {ms:.2f} | {ms / base:.3f} |")
    print("\nratios: to the anchor; EvenSteps to the same shards without it")


if __name__ == "__main__":
    run_main(main)
