"""Time per optimizer step with gradient accumulation K=8, with and without no_sync, on 2 CPU ranks.

Manual optimization on a ~3.2M-parameter MLP. Both variants run the same LightningModule, which
steps every K-th batch; the only difference is the ``AccumulationNoSync`` callback (with it, the
7 non-boundary micro-batches skip the gradient all-reduce). ``AllReduceCounter`` reports what was
sent. The variants alternate (A B A B A B) in one run and the median step time of each is compared.

    .venv/bin/python benchmarks/bench_accumulation.py
"""

import logging
import os
import statistics
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_plugins.core import run_main
from ddp_plugins.lightning import AccumulationNoSync, AllReduceCounter
from ddp_plugins.testing import LOOPBACK_ENV

K = 8
STEPS = 8  # optimizer steps per fit; the first is warm-up and not timed
BATCH = 32
WIDTH = 1024
REPEATS = 3


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)
        )
        self.step_ends: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x), y) / K)
        if (batch_idx + 1) % K == 0:  # the same boundaries with or without the callback
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()
            self.step_ends.append(time.perf_counter())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.trainer.world_size * BATCH * K * STEPS
        data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
        sampler = DistributedSampler(data, self.trainer.world_size, self.trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)


def _fit(no_sync: bool) -> tuple[list[float], AllReduceCounter]:
    counter = AllReduceCounter(log=False)
    callbacks = [AccumulationNoSync(K), counter] if no_sync else [counter]
    model = _Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    ends = model.step_ends
    return [b - a for a, b in zip(ends, ends[1:], strict=False)], counter


def main() -> None:
    os.environ.update(LOOPBACK_ENV)  # gloo over loopback, one thread per rank; the child rank inherits it
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    times: dict[bool, list[float]] = {False: [], True: []}
    counts: dict[bool, AllReduceCounter] = {}
    for _ in range(REPEATS):
        for no_sync in (False, True):
            step_times, counter = _fit(no_sync)
            times[no_sync] += step_times
            counts[no_sync] = counter
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    params = sum(p.numel() for p in _Net().parameters())
    rows = []
    for no_sync, name in ((False, "all-reduce every micro-step"), (True, "AccumulationNoSync")):
        c = counts[no_sync]
        rows.append(
            (
                name,
                statistics.median(times[no_sync]) * 1e3,
                c.calls / c.optimizer_steps,
                c.rounds / c.optimizer_steps,
                c.bytes / c.optimizer_steps / 2**20,
            )
        )
    ratio = rows[0][1] / rows[1][1]
    print(
        f"\nK={K}, {params / 1e6:.2f}M parameters, batch {BATCH}/rank, 2 CPU ranks (gloo), median of "
        f"{len(times[True])} timed optimizer steps per variant\n"
    )
    print("| variant | ms / optimizer step | all-reduce calls / step | rounds / step | MiB sent / step / rank |")
    print("|---|---:|---:|---:|---:|")
    for name, ms, calls, rounds, mib in rows:
        print(f"| {name} | {ms:.1f} | {calls:.1f} | {rounds:.1f} | {mib:.1f} |")
    print(f"\nspeed-up with no_sync: {ratio:.2f}x (time per optimizer step, without / with)")


if __name__ == "__main__":
    run_main(main)
