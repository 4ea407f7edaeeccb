"""Training app
============

``python -m ddp_plugins.train [group=option ...] [key=value ...]`` (what ``make train`` runs) trains
the configured model with DDP and prints the final validation accuracy. The configs are the
packaged ``ddp_plugins.conf`` (the checkout's ``conf/``), found through Hydra's package search
path, so the installed package runs as the checkout does.

Everything the user can get wrong is checked before Hydra creates a run folder and before any
worker process starts (:mod:`ddp_plugins.app.checks`); an error is one line on stderr and exit
code 2. Checkpoints, metrics (CSV) and the resolved config go to the Hydra run folder, one per
run: the child ranks of a job write into their parent's folder. Under ``--multirun`` each job is
a full DDP run in its own folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import hydra
from omegaconf import DictConfig, OmegaConf

from ddp_plugins.app.checks import CONFIG_MODULE, CONFIG_NAME, ConfigError, precheck, resolve_precision
from ddp_plugins.core.preemption import Preempted
from ddp_plugins.core.process import exit_at_interpreter_exit, owns_exit, run_main, system_exit_code
from ddp_plugins.core.ranks import get_rank, setup_rank_logging
from ddp_plugins.lightning.network import apply_network_env, restore_env

__all__ = ["build_trainer", "main", "resume_path", "run_folder_lock", "train"]

_ERROR_EXIT = 2

log = logging.getLogger("ddp_plugins.train")  # not __name__: "__main__" under python -m


def build_trainer(cfg: DictConfig, output_dir: str | os.PathLike, callbacks: list[Any] | None = None) -> Any:
    """The Lightning ``Trainer`` a config describes, writing logs and checkpoints to ``output_dir``.

    Example::

        >>> import tempfile
        >>> from ddp_plugins.app.checks import compose_config
        >>> cfg = compose_config(["trainer.accelerator=cpu", "trainer.devices=1", "trainer.max_epochs=2"])
        >>> trainer = build_trainer(cfg, tempfile.mkdtemp())
        >>> trainer.max_epochs, type(trainer.strategy).__name__, trainer.logger.name
        (2, 'DDPPluginsStrategy', 'metrics')
    """
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddp_plugins.lightning.csv_logger import ResumableCSVLogger

    precision = resolve_precision(cfg.precision.name, str(cfg.trainer.get("accelerator", "auto")))
    strategy = instantiate(cfg.strategy)
    plugin_callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    checkpoint = ModelCheckpoint(
        dirpath=Path(output_dir) / "checkpoints", monitor=_accuracy_key(cfg), mode="max", save_last=True
    )
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(trainer_args, dict)
    return pl.Trainer(
        **cast("dict[str, Any]", trainer_args),
        strategy=strategy,
        precision=precision,
        callbacks=[*plugin_callbacks, checkpoint, *(callbacks or [])],
        logger=ResumableCSVLogger(save_dir=str(output_dir), name="metrics", version=""),
        default_root_dir=str(output_dir),
    )


def _accuracy_key(cfg: DictConfig) -> str:
    """The exact accuracy of SequentialEvaluation when it is on, else the model's own."""
    sequential = (cfg.get("callbacks") or {}).get("sequential_evaluation") or {}
    return "val/exact_acc" if "exact_acc" in (sequential.get("metrics") or {}) else "val/acc"


def train(cfg: DictConfig, output_dir: str | os.PathLike) -> float | None:
    """Fit the configured model; returns the final validation accuracy on rank 0 (None elsewhere)."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    setup_rank_logging()  # ddp_plugins loggers: INFO on rank 0, WARNING on the other ranks
    network_env = apply_network_env(cfg.get("network", {}).get("env"))
    if network_env:
        log.info("network environment: %s", network_env)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    trainer = build_trainer(cfg, output_dir)
    ckpt_path = resume_path(str(cfg.get("resume", "auto")), output_dir)
    if ckpt_path is not None and get_rank() == 0:
        epoch, step = _checkpoint_position(ckpt_path)
        print(f"resuming from {ckpt_path} (epoch {epoch}, step {step})", flush=True)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics, key = trainer.callback_metrics, _accuracy_key(cfg)
    if not trainer.is_global_zero or key not in metrics:
        return None
    accuracy = float(metrics[key])
    print(f"final validation accuracy: {accuracy:.4f} ({key}; run folder: {output_dir})", flush=True)
    return accuracy


def resume_path(resume: str, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint a run continues from: ``resume`` itself, the newest of the run folder's
    ``checkpoints/`` for ``"auto"`` (None when it has none), None for ``"never"``.

    Example::

        >>> import tempfile
        >>> resume_path("auto", tempfile.mkdtemp()) is None, resume_path("never", "outputs/x")
        (True, None)
    """
    from ddp_plugins.core.checkpoints import latest_checkpoint

    if resume == "never":
        return None
    if resume != "auto":
        return resume
    latest = latest_checkpoint(Path(output_dir) / "checkpoints")
    return str(latest) if latest is not None else None


def _checkpoint_position(path: str) -> tuple[int, int]:
    """(epoch, global step) stored in a Lightning checkpoint, read without loading its tensors."""
    import torch

    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return int(checkpoint.get("epoch", 0)), int(checkpoint.get("global_step", 0))


@contextlib.contextmanager
def run_folder_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold ``<folder>/.lock`` while a run writes there; a second run in the same folder is refused.

    Two runs writing one folder would interleave checkpoints and metrics, and ``resume=auto`` would
    continue the other's. The lock is the kernel's (``flock``): it goes with the process, so a killed,
    requeued or restarted job finds its folder free.

    Raises:
        ConfigError: another process holds the folder.
    """
    import fcntl

    path = Path(folder) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise ConfigError(
                "hydra.run.dir", f"{folder} is in use by a running job ({holder})", "a folder no running job writes to"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"PID {os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _reset_job_state(env_before: dict[str, str]) -> None:
    """Leave the process as the next job of a sweep expects it: no process group, the environment
    as it was before the job (launcher variables, network presets and ports must not leak)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Free the job's DDP reducer first, while the process group is still registered: a
        # reducer that held the last reference would join the gloo threads with the GIL held.
        gc.collect()
        dist.destroy_process_group()
    restore_env(env_before)


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    env_before = dict(os.environ)
    output_dir = HydraConfig.get().runtime.output_dir
    try:
        with run_folder_lock(output_dir) if get_rank() == 0 else contextlib.nullcontext():
            return train(cfg, output_dir)
    except ConfigError as err:  # a job whose config changed after the up-front check
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(_ERROR_EXIT) from None
    except Preempted as stop:  # every rank stopped at the same step; exit code 128 + signal
        if get_rank() == 0:
            print(f"[ddp_plugins] {stop}", file=sys.stderr, flush=True)
        raise
    finally:
        if "LOCAL_RANK" not in env_before:  # the job's launcher, not one of its child ranks
            _reset_job_state(env_before)
        code = _interpreter_exit_code(sys.exc_info()[1])
        if not owns_exit() and code is not None:
            # Run by another entry point (a submitit task): skip finalization all the same, as
            # the gloo abort at exit would turn a finished job into a failed Slurm task.
            exit_at_interpreter_exit(code)


def _interpreter_exit_code(error: BaseException | None) -> int | None:
    """The code the process exits with after the job ended with ``error`` (None: unknown).

    An exception becomes the job's result in Hydra's ``run_job`` (exit 0); a ``SystemExit``
    (``Preempted``, a config error) goes through to the interpreter with its code.
    """
    if error is None or isinstance(error, Exception):
        return 0
    if isinstance(error, SystemExit):
        return system_exit_code(error)
    return None


def _main() -> None:
    argv = sys.argv[1:]
    try:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # a launcher's child rank re-runs a checked job
            precheck(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(_ERROR_EXIT) from None
    _hydra_main()


def main() -> None:
    """Console entry point: run the app and exit without the gloo shutdown abort."""
    run_main(_main)


if __name__ == "__main__":
    main()
