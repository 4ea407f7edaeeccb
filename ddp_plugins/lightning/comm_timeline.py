"""A callback timing every rank's steps and collectives on one clock; see docs/design.md, "Where time goes"."""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from ddp_plugins.core.checks import ArgumentTypeError, check_bool, check_int, check_number
from ddp_plugins.core.timeline import Timeline
from ddp_plugins.lightning._loggers import log_to_loggers
from ddp_plugins.lightning.comm_hook_chain import add_comm_hook_layer, register_on_model, remove_comm_hook_layers

__all__ = ["CommTimeline"]

_MAX_PER_RANK_SCORES = 16  # straggler/score_rank<r> is logged for worlds up to this size


class CommTimeline(Callback):
    """Time every rank's steps and collectives, blame the slow rank, and trace it all on one timeline.

    A ``Timeline`` per rank, gathered into ``time/*`` and ``straggler/*`` metrics, and a Chrome trace (docs/plugins.md).
    Untimed: metric syncs; DDP's buckets under a CUDA ``ddp_comm_hook`` are timed with ``DDPPluginsStrategy`` only.

    Args:
        every_n_steps: batches between two gathers of the records (and the logged metrics).
        trace_path: where rank 0 writes the trace; ``None`` for ``<log_dir>/comm_timeline.json``.
        history: collectives kept per rank (``timeline.recent``).
        blame_threshold_ms: the least excess in a batch that blames the batch on a rank.
        score_decay: weight of the newest batch in the moving straggler score.
        log: write the metrics to the Trainer's loggers.

    Example::

        >>> timeline = CommTimeline(every_n_steps=20)
        >>> timeline.summary
        {}
        >>> # Trainer(strategy="ddp", callbacks=[timeline]); trainer.fit(model) -> timeline.summary
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        trace_path: str | os.PathLike | None = None,
        history: int = 64,
        blame_threshold_ms: float = 5.0,
        score_decay: float = 0.1,
        log: bool = True,
    ) -> None:
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        if trace_path is not None and not isinstance(trace_path, (str, os.PathLike)):
            raise ArgumentTypeError("trace_path", "a path or None", trace_path)
        self.trace_path = Path(trace_path) if trace_path is not None else None
        self.history = check_int("history", history, 1)
        self.blame_threshold_ms = check_number("blame_threshold_ms", blame_threshold_ms, 0.0)
        self.score_decay = check_number("score_decay", score_decay, 0.0, 1.0, exclusive_minimum=True)
        # not `self.log`: Lightning sets every callback's `log` to the module's at fit start
        self.log_metrics = check_bool("log", log)
        self.spawn_results_key = uuid.uuid4().hex  # pairs this callback with its copy in spawned ranks
        self.timeline: Timeline | None = None
        self._summary: dict[str, Any] = {}
        self._strategy: DDPStrategy | None = None
        self._handles: list[Any] = []
        self._batch = 0
        self._stepping = False

    @property
    def summary(self) -> dict[str, Any]:
        """The last fit's :meth:`Timeline.summary` (``{}`` before one), with the ``trace`` path on rank 0."""
        return self._summary

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.timeline = Timeline(
            history=self.history, blame_threshold_s=self.blame_threshold_ms / 1e3, score_decay=self.score_decay
        )
        if isinstance(trainer.strategy, DDPStrategy):
            self._strategy = trainer.strategy
            add_comm_hook_layer(self._strategy, self.timeline.comm_hook)
        if self.trace_path is None:
            self.trace_path = Path(trainer.log_dir or trainer.default_root_dir) / "comm_timeline.json"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.timeline is not None
        self.timeline.activate()
        self.timeline.sync_clocks()
        if self._strategy is not None:
            register_on_model(self._strategy)
            if isinstance(self._strategy.model, DistributedDataParallel):
                self._handles = self.timeline.time_buffer_broadcast(self._strategy.model)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.timeline is not None:
            self.timeline.begin_step(self._batch)
            self._stepping = False

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.timeline is not None:
            self.timeline.mark("forward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timeline is not None:
            self.timeline.mark("backward")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.timeline is not None:
            self.timeline.skip()  # gradient clipping and the like are no phase; the step's math follows
            self._stepping = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.timeline is None:
            return
        if self._stepping:
            self.timeline.mark("optimizer")
        self.timeline.end_step()
        self._batch += 1
        if self._batch % self.every_n_steps == 0:
            self._log(trainer, self.timeline.collect())

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.timeline is not None:
            self.timeline.collect()  # the batches since the last gather
            self._finish(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.timeline is not None:
            self._finish(trainer)  # what was gathered so far (no collective here)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.timeline is not None:
            self.timeline.deactivate()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._strategy is not None:
            remove_comm_hook_layers(self._strategy)
            self._strategy = None

    def export_results(self) -> str:
        """Write the summary (spawned rank 0) to a temporary file; the path travels back."""
        with tempfile.NamedTemporaryFile("w", prefix="ddp_plugins_timeline_", suffix=".json", delete=False) as file:
            json.dump(self._summary, file)
        return file.name

    def import_results(self, path: str) -> None:
        """Take the summary a spawned rank 0 exported to ``path`` (and remove the file)."""
        try:
            summary = json.loads(Path(path).read_text())
        finally:
            os.remove(path)
        summary["blamed_steps"] = {int(rank): steps for rank, steps in summary["blamed_steps"].items()}  # JSON keys
        self._summary = summary

    def _finish(self, trainer: pl.Trainer) -> None:
        assert self.timeline is not None
        s = self._summary = self.timeline.summary()
        if trainer.global_rank != 0 or self.trace_path is None:
            return
        s["trace"] = str(self.timeline.write_chrome_trace(self.trace_path))
        shares = ", ".join(f"{kind} {share:.1%}" for kind, share in s["comm_share"].items()) or "none"
        who = (
            f"slowest rank {s['slowest_rank']}, +{s['excess_ms_per_step']:.2f} ms per step"
            f" (blamed in {s['blamed_steps'].get(s['slowest_rank'], 0)} of {s['steps']} steps)"
            if s["slowest_rank"] is not None
            else f"no straggler in {s['steps']} steps"
        )
        rank_zero_info(
            f"CommTimeline: {who}; step time in collectives: {shares}; clocks aligned within"
            f" {s['clock_residual_us']:g} us; trace: {s['trace']}"
        )

    def _log(self, trainer: pl.Trainer, report: dict[str, Any]) -> None:
        if not self.log_metrics or not report["steps"]:
            return
        metrics = {f"time/{phase}_ms": value for phase, value in report["phases_ms"].items()}
        metrics.update({f"time/comm/{kind}_ms": value for kind, value in report["comm_ms"].items()})
        metrics["time/waited_for_last_ms"] = report["wait_ms"]
        scores = report["scores"]
        if scores:
            slowest = max(scores, key=scores.get)
            metrics["straggler/slowest_rank"] = slowest
            metrics["straggler/score_max_ms"] = scores[slowest]
        metrics["straggler/blamed_steps"] = len(report["blamed"])
        if trainer.world_size <= _MAX_PER_RANK_SCORES:
            metrics.update({f"straggler/score_rank{r}": score for r, score in scores.items()})
        log_to_loggers(trainer, {k: float(v) for k, v in metrics.items()})
