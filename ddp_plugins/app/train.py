"""``python -m ddp_plugins.train [group=option ...] [key=value ...]``: DDP training of the configured model.

Prints the final validation accuracy; checkpoints, metrics and the resolved config go to the Hydra run folder."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, cast

import hydra
import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from ddp_plugins.app.config import CONFIG_MODULE, CONFIG_NAME, ConfigError, resolve_precision, trainer_args
from ddp_plugins.app.hydra_args import hydra_quote, job_subprocess_cmd
from ddp_plugins.app.precheck import load_checkpoint_safely, precheck, single_run_config
from ddp_plugins.core import checkpoints
from ddp_plugins.core.liveness import RendezvousError
from ddp_plugins.core.preemption import Preempted
from ddp_plugins.core.process import exit_at_interpreter_exit, owns_exit, run_main, system_exit_code
from ddp_plugins.core.ranks import get_rank, setup_rank_logging
from ddp_plugins.lightning.launchers import end_launched_job
from ddp_plugins.lightning.network import apply_network_env, restore_env
from ddp_plugins.lightning.reproducible import state_fingerprint
from ddp_plugins.lightning.resume import CHECKPOINT_KEY as DATA_RECORD
from ddp_plugins.lightning.resume import ResumeMismatch, expected_record, resume_start

__all__ = ["build_trainer", "hold_run_folder", "main", "resume_path", "run_folder_lock", "train"]

_ERROR_EXIT = 2

log = logging.getLogger("ddp_plugins.train")  # not __name__: "__main__" under python -m


def build_trainer(cfg: DictConfig, output_dir: str | os.PathLike, callbacks: list[Any] | None = None) -> Any:
    """The Lightning ``Trainer`` a config describes, writing logs and checkpoints to ``output_dir``.

    Example::

        >>> import tempfile
        >>> from ddp_plugins.app.config import compose_config
        >>> cfg = compose_config(["trainer.accelerator=cpu", "trainer.devices=1", "trainer.max_epochs=2"])
        >>> trainer = build_trainer(cfg, tempfile.mkdtemp())
        >>> trainer.max_epochs, type(trainer.strategy).__name__, trainer.logger.name
        (2, 'DDPPluginsStrategy', 'metrics')
    """
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    precision = resolve_precision(cfg.precision.name, accelerator, bool(cfg.get("reproducible")))
    strategy = instantiate(cfg.strategy, child_command=job_subprocess_cmd)  # child ranks re-run this job only
    plugin_callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    folder = Path(output_dir) / "checkpoints"
    # last.ckpt at every epoch end: a kill loses at most one epoch (save_last=True: only when the best improves)
    best = ModelCheckpoint(dirpath=folder, monitor=_accuracy_key(cfg), mode="max")
    latest = ModelCheckpoint(dirpath=folder, filename="last", monitor=None, enable_version_counter=False)
    return pl.Trainer(
        **trainer_args(cfg.trainer),
        strategy=strategy,
        precision=precision,
        callbacks=[*plugin_callbacks, best, latest, *(callbacks or [])],
        logger=instantiate(cfg.logger, save_dir=str(output_dir)),
        default_root_dir=str(output_dir),
    )


def _accuracy_key(cfg: DictConfig) -> str:
    """The exact accuracy of SequentialEvaluation when it is on, else the model's own."""
    sequential = (cfg.get("callbacks") or {}).get("sequential_evaluation") or {}
    return "val/exact_acc" if "exact_acc" in (sequential.get("metrics") or {}) else "val/acc"


def train(cfg: DictConfig, output_dir: str | os.PathLike) -> float | None:
    """Fit the configured model; returns the final validation accuracy on rank 0 (None elsewhere)."""
    setup_rank_logging()  # ddp_plugins loggers: INFO on rank 0, WARNING on the other ranks
    # Lightning 2.6's own call into torch 2.13's pytree, once per rank and fit: nothing the user can act on
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    if cfg.precision.name == "64-true":
        model = model.double()  # before a resume restores its weights: float32 parameters would round them
    resume = str(cfg.get("resume", "auto"))
    weights_only = cfg.get("weights_only", True) is not False  # false: the user trusts their checkpoints
    _prepare_checkpoint_folder(Path(output_dir) / "checkpoints", resume)
    # decided before the Trainer (its banner) and the other ranks start: a refusal is one line, a finished run says so
    ckpt_path = resume_path(resume, output_dir, weights_only=weights_only)
    point = _check_resume_checkpoint(ckpt_path, model, datamodule, cfg) if ckpt_path is not None else None
    if point is not None and point.finished:
        if get_rank() != 0:
            return None
        accuracy = _final_accuracy(Path(str(ckpt_path)), point, _accuracy_key(cfg), weights_only)
        shown = "unknown" if accuracy is None else f"{accuracy:.4f}"
        print(f"already finished at epoch {point.epoch} (accuracy {shown}; run folder: {output_dir})", flush=True)
        return accuracy
    network_env = apply_network_env(cfg.get("network", {}).get("env"))
    if network_env:
        log.info("network environment: %s", network_env)
    trainer = build_trainer(cfg, output_dir)
    if point is not None:
        # A resume writes into its own checkpoint folder by design: one "resuming from" line says it
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        if get_rank() == 0:
            n, was = trainer.world_size, point.world_size
            ranks = f" on {n} rank{'s' * (n != 1)}" + (f" (was {was})" if was and was != n else "")
            print(f"resuming from {ckpt_path} (epoch {point.epoch}, step {point.step}){ranks}", flush=True)
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only)
    metrics, key = trainer.callback_metrics, _accuracy_key(cfg)
    if not trainer.is_global_zero or key not in metrics:
        return None
    accuracy = float(metrics[key])
    print(f"final validation accuracy: {accuracy:.4f} ({key}; run folder: {output_dir})", flush=True)
    optimizers = [optimizer.state_dict() for optimizer in trainer.optimizers]
    print(f"state fingerprint: {state_fingerprint(model.state_dict(), optimizers)}", flush=True)
    return accuracy


def resume_path(resume: str, output_dir: str | os.PathLike, weights_only: bool = True) -> str | None:
    """The checkpoint to continue from: ``resume``, the newest verified one for ``"auto"``, None for ``"never"``/none.

    ``"auto"`` skips (and warns about) damaged or unverified files; ``weights_only``: how they are read.

    Example::

        >>> import tempfile
        >>> resume_path("auto", tempfile.mkdtemp()) is None, resume_path("never", "outputs/x")
        (True, None)
    """
    if resume == "never":
        return None
    if resume != "auto":
        return resume
    folder = Path(output_dir) / "checkpoints"
    found, skipped = checkpoints.newest_valid_checkpoint(folder)
    if found is None and skipped:  # starting over would silently overwrite these damaged or unverified files
        names = "; ".join(f"{path.name}: {reason.split(':')[0]}" for path, reason in skipped)
        raise ConfigError(
            "resume",
            f"got 'auto', but no checkpoint in {folder} verifies ({names})",
            "resume=<one of them> to continue from it unverified, or resume=never with a new hydra.run.dir",
        )
    if get_rank() == 0:
        for path, reason in skipped:
            log.warning("resume: skipped %s (%s)", path, reason)
    return str(_the_stop_at_the_same_step(found, weights_only)) if found is not None else None


_PREEMPTED = re.compile(r"step-(\d+)-preempted\.ckpt")


def _the_stop_at_the_same_step(found: Path, weights_only: bool = True) -> Path:
    """A valid preemption checkpoint of ``found``'s step (preferred: it records the stop), else ``found``."""
    if _PREEMPTED.fullmatch(found.name):
        return found
    stops = {p: int(m.group(1)) for p in found.parent.iterdir() if (m := _PREEMPTED.fullmatch(p.name))}
    if not stops:
        return found
    try:
        step = int(load_checkpoint_safely(found, weights_only).get("global_step", -1))
    except (ValueError, AttributeError):
        return found  # reported when it is loaded
    same = [p for p, s in stops.items() if s == step and checkpoints.verify_checkpoint(p) is None]
    return max(same, key=checkpoints.write_order) if same else found


def _prepare_checkpoint_folder(folder: Path, resume: str) -> None:
    """Refuse ``resume=never`` over an earlier run's checkpoints (they would mix); remove a killed writer's files."""
    if resume == "never" and any(folder.glob("*.ckpt")):
        raise ConfigError(
            "resume",
            f"got 'never', but {folder} holds the checkpoints of an earlier run",
            "'auto' to continue that run, or resume=never with a new hydra.run.dir",
        )
    if get_rank() == 0:  # the folder is locked by this job: no other writer has a temporary file there
        removed = checkpoints.remove_stale_temporaries(folder)
        if removed:
            log.info("removed %d file(s) a killed run left in %s", len(removed), folder)


_SAME_MODEL = "a checkpoint of the same model.* settings, or resume=never with a new hydra.run.dir"


class ResumePoint(NamedTuple):
    """Where a checkpoint stands, as :func:`_check_resume_checkpoint` read it."""

    epoch: int  # Lightning's epoch (0-based), as in the checkpoint's file name
    step: int  # global step
    world_size: int | None  # the ranks that wrote it (None: not recorded)
    finished: bool  # it holds the end of the run this config asks for (max_epochs / max_steps reached)
    accuracy: float | None  # the last validation accuracy it recorded (the app's accuracy key), if any


def _check_resume_checkpoint(path: str, model: Any, datamodule: Any, cfg: DictConfig) -> ResumePoint:
    """Where the checkpoint to resume from stands, once checked against ``model`` and the config.

    Raises:
        ConfigError: the checkpoint does not load safely or does not fit the model or the config.
        ResumeMismatch: this run would train some of the stopped epoch's rows twice or never.
    """
    try:
        checkpoint = load_checkpoint_safely(path, weights_only=cfg.get("weights_only", True) is not False)
    except ValueError as err:
        raise ConfigError("resume", f"got {path!r} ({err})", "a checkpoint written by ddp_plugins") from None
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not isinstance(checkpoint.get("loops"), dict):
        found = "a bare state_dict" if isinstance(checkpoint, dict) and state is None else "no state_dict and loops"
        raise ConfigError(
            "resume", f"got {path!r} (not a Lightning checkpoint: {found})", "a checkpoint written by Trainer.fit"
        )
    own = model.state_dict()
    misfits = [
        f"{key} has shape {tuple(state[key].shape)} in the checkpoint and {tuple(tensor.shape)} in the model"
        if key in state
        else f"it has no {key!r}"
        for key, tensor in own.items()
        if key not in state or tuple(state[key].shape) != tuple(tensor.shape)
    ]
    misfits += [f"the model has no {key!r}" for key in state if key not in own]
    if misfits:
        raise ConfigError("resume", f"{path} does not fit the model: {misfits[0]}", _SAME_MODEL)
    max_epochs = cfg.trainer.get("max_epochs")
    for scheduler in checkpoint.get("lr_schedulers") or []:
        t_max = scheduler.get("T_max") if isinstance(scheduler, dict) else None
        if get_rank() == 0 and isinstance(t_max, int) and isinstance(max_epochs, int) and max_epochs > t_max:
            log.warning(
                "resume: the restored learning-rate schedule ends after epoch %d (T_max=%d) and is kept:"
                " the epochs from %d on follow it past its end (the cosine rises again from its minimum)."
                " For one schedule over trainer.max_epochs=%d, start a new run",
                t_max - 1, t_max, t_max, max_epochs,
            )  # fmt: skip
    record = checkpoint.get(DATA_RECORD) or {}
    was = record.get("world_size") if isinstance(record, dict) else None
    epoch, step = int(checkpoint.get("epoch", 0)), int(checkpoint.get("global_step", 0))
    try:  # the epochs its fit loop has processed (Lightning's progress record)
        epochs_done = int(checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        epochs_done = 0
    max_steps = cfg.trainer.get("max_steps", -1)
    if isinstance(max_epochs, int) and max_epochs >= 0 and epochs_done > max_epochs:
        raise ConfigError(
            "trainer.max_epochs",
            f"got {max_epochs}, fewer than the {epochs_done} epochs {path} has trained",
            f"at least {epochs_done} to continue that run, or resume=never with a new hydra.run.dir",
        )
    finished = (isinstance(max_epochs, int) and max_epochs >= 0 and epochs_done >= max_epochs) or (
        isinstance(max_steps, int) and max_steps > 0 and step >= max_steps
    )
    now = _expected_record(cfg, datamodule) if isinstance(record, dict) and record and not finished else None
    if now is not None:  # what the ranks would refuse (ResumeMismatch), decided from the numbers alone
        progress = (checkpoint["loops"].get("fit_loop") or {}).get("epoch_loop.batch_progress") or {}
        current = progress.get("current") or {}
        done = int(current.get("processed", 0))
        resume_start(
            record, now, epoch, done, last_batch=bool(progress.get("is_last_batch")),
            in_batch_end=int(current.get("completed", done)) < done,
        )  # fmt: skip
    # a file with a digest was verified on the way here; warned after every refusal, so a refusal stays one line
    digest = checkpoints.digest_path(path)
    if get_rank() == 0 and not digest.is_file():
        log.warning("resume: %s is not verified (%s: %s missing)", path, checkpoints.NO_DIGEST, digest.name)
    return ResumePoint(epoch, step, was, finished, _recorded_accuracy(checkpoint, _accuracy_key(cfg)))


def _expected_record(cfg: DictConfig, datamodule: Any) -> dict[str, Any] | None:
    """The data record the ranks will write; None if left open (an accumulation schedule, unknown rows, GPU indices)."""
    rows = getattr(datamodule, "train_rows", None)
    trainer = trainer_args(cfg.trainer)
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    accumulate = {trainer.get("accumulate_grad_batches", 1)}
    no_sync = (cfg.get("callbacks") or {}).get("accumulation_no_sync") or {}
    if no_sync.get("accumulate_grad_batches", 1) != 1:
        accumulate.add(no_sync.get("accumulate_grad_batches"))
        accumulate.discard(1)
    batch_size, strategy = cfg.data.get("batch_size"), cfg.get("strategy") or {}
    numbers = (rows, devices, nodes, batch_size, *accumulate)
    if len(accumulate) != 1 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in numbers):
        return None
    return expected_record(
        cast(int, rows), devices * nodes, accumulate.pop(), batch_size, int(cfg.seed),
        global_batch_size=strategy.get("global_batch_size"), drop_last=bool(strategy.get("drop_last", False)),
        limit_train_batches=trainer.get("limit_train_batches", 1.0),
        virtual_shards=strategy.get("virtual_shards") if strategy.get("reproducible") else None,
    )  # fmt: skip


def _final_accuracy(path: Path, point: ResumePoint, key: str, weights_only: bool = True) -> float | None:
    """The accuracy a finished run ended with: ``last.ckpt``'s if it holds ``path``'s step, else ``path``'s own.

    A stop at the last step is written before the epoch's ``ModelCheckpoint`` updates its score."""
    last = path.with_name("last.ckpt")
    if last != path and checkpoints.verify_checkpoint(last) is None:
        with contextlib.suppress(ValueError, AttributeError):
            checkpoint = load_checkpoint_safely(last, weights_only)
            recorded = _recorded_accuracy(checkpoint, key)
            if int(checkpoint.get("global_step", -1)) == point.step and recorded is not None:
                return recorded
    return point.accuracy


def _recorded_accuracy(checkpoint: dict[str, Any], key: str) -> float | None:
    """The last value of ``key`` a ``ModelCheckpoint`` monitoring it recorded in ``checkpoint``."""
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, dict) and state.get("monitor") == key and state.get("current_score") is not None:
            return float(state["current_score"])
    return None


_held_folders: dict[str, Any] = {}  # run folders this process locked for its whole life (real path -> handle)


def _acquire_run_folder(folder: str | os.PathLike) -> Any:
    """An open ``<folder>/.lock`` holding the kernel's exclusive ``flock`` (see :func:`run_folder_lock`)."""
    path = Path(folder) / ".lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # held until released or the process ends
    except OSError as err:
        raise ConfigError(
            "hydra.run.dir", f"{folder} cannot be written ({err.strerror or err})", "a folder this user can write to"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            "hydra.run.dir", f"{folder} is in use by a running job ({holder})", "a folder no running job writes to"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"PID {os.getpid()}\n")
    handle.flush()
    return handle


def hold_run_folder(folder: str | os.PathLike) -> None:
    """Lock the run folder for the rest of this process's life, before Hydra writes ``.hydra/`` there.

    Raises:
        ConfigError: another process holds the folder, or it cannot be written.
    """
    key = os.path.realpath(folder)
    if key not in _held_folders:
        _held_folders[key] = _acquire_run_folder(folder)


@contextlib.contextmanager
def run_folder_lock(folder: str | os.PathLike) -> Iterator[None]:
    """Hold ``<folder>/.lock`` while a run writes there; a second run in the same folder is refused.

    The kernel's ``flock`` goes with the process, so a killed or requeued job finds its folder free.
    Not ``filelock``: it keeps its descriptor private, and the refusal names the holder's PID.

    Raises:
        ConfigError: another process holds the folder, or it cannot be written.
    """
    if os.path.realpath(folder) in _held_folders:
        yield
        return
    handle = _acquire_run_folder(folder)
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _reset_job_state(env_before: dict[str, str]) -> None:
    """Leave the process as a sweep's next job expects it: no process group, no launcher/network variable leaked."""
    end_launched_job()
    restore_env(env_before)


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    env_before = dict(os.environ)
    output_dir = HydraConfig.get().runtime.output_dir
    try:
        with run_folder_lock(output_dir) if get_rank() == 0 else contextlib.nullcontext():
            return train(cfg, output_dir)
    # ConfigError: a job whose config changed after the up-front check, or its checkpoint;
    # ResumeMismatch: every rank refuses the same resume, so one line, from rank 0
    except (ConfigError, ResumeMismatch) as err:
        if isinstance(err, ConfigError) or get_rank() == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(_ERROR_EXIT) from None
    except RendezvousError as err:  # a rank that never came: one line, not a store traceback per rank
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EROFS, errno.EDQUOT):
            raise
        where = f": {err.filename}" if err.filename else ""
        print(f"error: {err.strerror or err}{where}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Preempted as stop:  # every rank stopped at the same step; exit code 128 + signal
        if get_rank() == 0:
            print(f"[ddp_plugins] {stop}", file=sys.stderr, flush=True)
        raise
    finally:
        if "LOCAL_RANK" not in env_before:  # the job's launcher, not one of its child ranks
            _reset_job_state(env_before)
        # Hydra's `run_job` makes an exception the job's result (exit 0); a SystemExit keeps its code
        error = sys.exc_info()[1]
        code = 0 if error is None or isinstance(error, Exception) else None
        if isinstance(error, SystemExit):
            code = system_exit_code(error)
        if not owns_exit() and code is not None:
            exit_at_interpreter_exit(code)  # e.g. a submitit task: the gloo exit abort would fail it


def _main() -> None:
    argv = sys.argv[1:]
    try:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # a launcher's child rank re-runs a checked job
            precheck(argv)
            cfg = single_run_config(argv) if get_rank() == 0 else None
            if cfg is not None:
                # locked and checked before Hydra writes .hydra/; handed to Hydra resolved (the same folder)
                folder = str(cfg.hydra.run.dir)
                hold_run_folder(folder)
                _prepare_checkpoint_folder(Path(folder) / "checkpoints", str(cfg.get("resume", "auto")))
                kept = [arg for arg in argv if not arg.lstrip("+").startswith("hydra.run.dir=")]
                sys.argv[1:] = [*kept, f"hydra.run.dir={hydra_quote(folder)}"]
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(_ERROR_EXIT) from None
    _hydra_main()


def main() -> None:
    """Console entry point: run the app and exit without the gloo shutdown abort."""
    run_main(_main)


if __name__ == "__main__":
    main()
