"""CommTimeline in a Trainer on 2 gloo ranks: the reported collective kinds traced, a slow rank blamed,
metrics logged, the user's and AllReduceCounter's hooks kept, torch.distributed untouched, the math unchanged."""

import json
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_plugins.lightning import (
    AllReduceCounter,
    CommTimeline,
    DDPPluginsStrategy,
    PreemptionCheckpoint,
    SyncBatchNormCallback,
)
from ddp_plugins.testing import run_lightning
from tests.core.test_comm_hooks import _user_hook
from tests.helpers.loggers import RecordingLogger
from tests.helpers.straggler import assert_blamed_for_slow_steps_only

_ALL_REDUCE = torch.distributed.all_reduce  # as imported, before any timeline
_PATCHED: list[int] = []  # the batches during which torch.distributed.all_reduce was not torch's

BATCH = 8  # per rank
BATCHES = 80  # per rank and epoch
SLOW_EVERY, SLEEP_S = 4, 0.05  # rank 1's loader sleeps before a quarter of its batches
BLAME_THRESHOLD_MS = 20  # under the injected delay, above the jitter of a shared 2-core machine (default 5)


class _SlowOnRank1:
    """A collate function that sleeps on rank 1 before every 4th batch: a slow data loader."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def __call__(self, rows):
        if self.rank == 1 and self.calls % SLOW_EVERY == 1:
            time.sleep(SLEEP_S)
        self.calls += 1
        return torch.utils.data.default_collate(rows)


class _Model(pl.LightningModule):
    def __init__(self, slow: bool, own_shards: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
        self.slow, self.own_shards = slow, own_shards

    def training_step(self, batch, batch_idx):
        if torch.distributed.all_reduce is not _ALL_REDUCE:
            _PATCHED.append(batch_idx)
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)  # a metric sync every step
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2 * BATCH * BATCHES, 8, generator=g)
        dataset = TensorDataset(x, x[:, :1] - x[:, 1:2])
        rank, world = self.trainer.global_rank, self.trainer.world_size
        collate = _SlowOnRank1(rank) if self.slow else None
        if self.own_shards:  # the same rows, as the rank's own shard: the strategy agrees on the batch count
            return DataLoader(Subset(dataset, range(rank, len(dataset), world)), batch_size=BATCH, collate_fn=collate)
        sampler = DistributedSampler(dataset, world, rank, shuffle=False)
        return DataLoader(dataset, batch_size=BATCH, sampler=sampler, collate_fn=collate)


def _fit(out_dir, callbacks, slow, own_shards=False):
    """The trained trainer, strategy, parameters and the metrics given to the loggers."""
    _user_hook.seen = 0
    logger = RecordingLogger()
    strategy = DDPPluginsStrategy(ddp_comm_hook=_user_hook, timeout=60)
    model = _Model(slow, own_shards)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        callbacks=[SyncBatchNormCallback(), PreemptionCheckpoint(dirpath=f"{out_dir}/ckpt"), *callbacks],
        enable_progress_bar=False,
        logger=logger,
        enable_checkpointing=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=out_dir,
    )
    trainer.fit(model)
    params = [p.detach().clone() for p in model.parameters()]
    return trainer, strategy, params, logger.latest()


def _kinds(trace_path):
    """The collective kinds a trace holds."""
    return {e["name"] for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("cat") == "collective"}


def _run(out_dir):
    _, _, plain, _ = _fit(out_dir, [], slow=False)
    # log=False logs nothing (Lightning sets every callback's `log` to the module's at fit start)
    quiet = [AllReduceCounter(log=False), CommTimeline(every_n_steps=20, log=False, trace_path=f"{out_dir}/q.json")]
    quiet_trainer, _, _, quiet_metrics = _fit(out_dir, quiet, slow=False, own_shards=True)
    counter, timeline = (
        AllReduceCounter(),
        CommTimeline(every_n_steps=20, blame_threshold_ms=BLAME_THRESHOLD_MS, trace_path=f"{out_dir}/trace.json"),
    )
    _, strategy, params, metrics = _fit(out_dir, [counter, timeline], slow=True)
    path = Path(out_dir) / "trace.json"
    trace = json.loads(path.read_text()) if path.exists() else None
    return {
        "same_math": all(torch.equal(a, b) for a, b in zip(plain, params, strict=True)),
        "summary": timeline.summary,
        "metrics": sorted(metrics),
        "quiet_metrics": sorted(quiet_metrics),
        "quiet_counted": quiet[0].rounds,
        "quiet_kinds": _kinds(Path(out_dir) / "q.json") if quiet_trainer.global_rank == 0 else None,
        "trace": trace,
        "user_seen": _user_hook.seen,
        "rounds": counter.rounds,
        "calls": counter.calls,
        "patched": _PATCHED,
        "hook_untouched": strategy._ddp_comm_hook is _user_hook,
        "restored": torch.distributed.all_reduce is _ALL_REDUCE,
    }


@pytest.mark.slow
def test_comm_timeline_traces_every_kind_blames_the_slow_rank_and_keeps_the_math():
    ranks = run_lightning(_run, timeout=240)
    for rank, out in enumerate(ranks):
        assert out["same_math"], f"rank {rank}: the timeline changed the trained weights"
        assert out["user_seen"] >= BATCHES and out["rounds"] == BATCHES, "the user's hook and the counter were kept"
        assert out["hook_untouched"], "the strategy's hook was rewritten"
        assert out["restored"] and out["patched"] == [], "torch.distributed.all_reduce is torch's own in every fit"
        assert {"time/forward_ms", "time/backward_ms", "time/data_wait_ms", "time/optimizer_ms"} <= set(out["metrics"])
        assert {"time/comm/ddp_bucket_ms", "straggler/slowest_rank", "straggler/score_rank1"} <= set(out["metrics"])
        assert {"comm/allreduce_rounds", "comm/allreduce_rounds_total"} <= set(out["metrics"])
        ours = [key for key in out["quiet_metrics"] if key.startswith(("time/", "straggler/", "comm/"))]
        assert ours == [], f"log=False logged {ours}"
        assert out["quiet_counted"] == BATCHES, "log=False still counts"
    # the strategy's agreement on the shards' batch count, labelled where data_plan calls it
    assert ranks[0]["quiet_kinds"] == {"ddp_bucket", "ddp_buffers", "agreement"}, ranks[0]["quiet_kinds"]
    summary = ranks[0]["summary"]
    assert summary["slowest_rank"] == 1, summary
    phases = [e for e in ranks[0]["trace"]["traceEvents"] if e.get("cat") == "phase" and e["pid"] == 1]
    # the steps rank 1 slept before: its data wait shows them (Lightning fetches a batch ahead)
    slow = {e["args"]["step"] for e in phases if e["name"] == "data_wait" and e["dur"] >= 0.8 * SLEEP_S * 1e6}
    expected = {step for step in range(BATCHES) if step % SLOW_EVERY == 1}
    assert len(slow & expected) >= len(expected) - 1, f"rank 1's sleeps should show as its data wait: {sorted(slow)}"
    blamed = {e["args"]["step"]: e["args"]["blamed"] for e in phases if e["name"] == "step"}
    assert_blamed_for_slow_steps_only(blamed, BATCHES, SLOW_EVERY)
    assert summary["trace"].endswith("trace.json")
    events = ranks[0]["trace"]["traceEvents"]
    assert ranks[1]["trace"] is None, "rank 0 writes the trace"
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    kinds = {e["name"] for e in events if e.get("cat") == "collective"}
    assert kinds == {"ddp_bucket", "ddp_buffers"}, f"reported: DDP's (not metric syncs, SyncBN's, barriers): {kinds}"
    for rank in (0, 1):  # the timeline's layer and the counter's saw the same buckets
        buckets = [e for e in events if e.get("name") == "ddp_bucket" and e["pid"] == rank]
        assert len(buckets) == ranks[rank]["calls"] >= BATCHES, (len(buckets), ranks[rank]["calls"])
    for name in ("data_wait", "forward", "backward", "optimizer", "step"):
        steps = [e for e in events if e.get("cat") == "phase" and e["name"] == name and e["pid"] == 1]
        assert len(steps) >= BATCHES - 1, f"{name}: {len(steps)} of {BATCHES} batches"
