"""A Lightning logger that keeps what it is given, for tests that read logged metrics."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import Logger


class RecordingLogger(Logger):
    """Every ``log_metrics`` call as ``(step, metrics)``, on every rank (no rank-zero filter)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def latest(self) -> dict[str, float]:
        """The last value of every metric."""
        out: dict[str, float] = {}
        for _, metrics in self.logged:
            out.update(metrics)
        return out
