"""Training app.

``python -m ddp_plugins.train [group=option ...] [key=value ...]`` (what ``make train`` runs) trains
the configured model with DDP and prints the final validation accuracy. The configs are the
packaged ``ddp_plugins.conf`` (the checkout's ``conf/``), found through Hydra's package search
path, so the installed package runs as the checkout does.

Everything the user can get wrong is checked before Hydra creates a run folder and before any
worker process starts (:mod:`ddp_plugins.config`); an error is one line on stderr and exit code 2.
Checkpoints, metrics (CSV) and the resolved config go to the Hydra run folder, one per run: the
child ranks of a job write into their parent's folder. Under ``--multirun`` each job is a full
DDP run in its own folder.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from ddp_plugins import config as config_checks
from ddp_plugins.distributed import run_main, setup_rank_logging

CONFIG_MODULE = "ddp_plugins.conf"
CONFIG_NAME = "train"

_ERROR_EXIT = 2

log = logging.getLogger("ddp_plugins.train")  # not __name__: "__main__" under python -m


def _hydra_flags_used(argv: list[str]) -> bool:
    """True when Hydra itself answers (``--help``, ``--cfg``, ...) or runs a sweep."""
    info = {"-h", "--help", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--version"}
    return any(arg in info or arg.startswith(("--cfg=", "--info=")) for arg in argv)


def _is_multirun(argv: list[str]) -> bool:
    return any(arg in ("-m", "--multirun") for arg in argv)


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose the app's config with Hydra's compose API (for notebooks and checks).

    Example::

        >>> cfg = compose_config(["backend=gloo", "trainer.max_epochs=1"])
        >>> cfg.backend.name, cfg.trainer.max_epochs
        ('gloo', 1)
    """
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return compose(config_name=CONFIG_NAME, overrides=list(overrides or []))


def precheck(argv: list[str]) -> None:
    """Every check that can run before Hydra makes a folder or Lightning starts a process.

    Raises:
        ConfigError: one line naming what was wrong and what is allowed.
    """
    config_flags, argv = config_checks.split_config_flags(argv)
    config_checks.check_overrides(argv)
    if _hydra_flags_used(argv) or _is_multirun(argv) or config_flags:
        # Sweeps and configs chosen with --config-name/-dir are composed per job by Hydra; each
        # job is checked in `train` before it starts.
        return
    overrides = [a for a in argv if not a.startswith(("-", "hydra.", "hydra/", "+hydra"))]
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose_config(overrides)
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        first = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise config_checks.ConfigError(f"bad override: {first}") from None
    config_checks.validate(resolved)


def build_trainer(cfg: DictConfig, output_dir: str | os.PathLike, callbacks: list[Any] | None = None) -> Any:
    """The Lightning ``Trainer`` a config describes, writing logs and checkpoints to ``output_dir``."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    config_checks.check_backend(cfg.backend.name, accelerator)
    precision = config_checks.resolve_precision(cfg.precision.name, accelerator)
    strategy = instantiate(cfg.strategy)
    plugin_callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    checkpoint = ModelCheckpoint(
        dirpath=Path(output_dir) / "checkpoints", monitor=_accuracy_key(cfg), mode="max", save_last=True
    )
    return pl.Trainer(
        **OmegaConf.to_container(cfg.trainer, resolve=True),
        strategy=strategy,
        precision=precision,
        callbacks=[*plugin_callbacks, checkpoint, *(callbacks or [])],
        logger=CSVLogger(save_dir=str(output_dir), name="metrics", version=""),
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

    from ddp_plugins.strategy import apply_network_env

    config_checks.validate(OmegaConf.to_container(cfg, resolve=True))
    setup_rank_logging()  # ddp_plugins loggers: INFO on rank 0, WARNING on the other ranks
    network_env = apply_network_env(cfg.get("network", {}).get("env"))
    if network_env:
        log.info("network environment: %s", network_env)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate(cfg.data)
    model = instantiate(cfg.model)
    trainer = build_trainer(cfg, output_dir)
    trainer.fit(model, datamodule=datamodule)
    metrics, key = trainer.callback_metrics, _accuracy_key(cfg)
    if not trainer.is_global_zero or key not in metrics:
        return None
    accuracy = float(metrics[key])
    print(f"final validation accuracy: {accuracy:.4f} ({key}; run folder: {output_dir})", flush=True)
    return accuracy


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
    for key in set(os.environ) - set(env_before):
        del os.environ[key]
    os.environ.update(env_before)


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name=CONFIG_NAME, version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    env_before = dict(os.environ)
    try:
        return train(cfg, HydraConfig.get().runtime.output_dir)
    except config_checks.ConfigError as err:  # a sweep job with a bad value
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(_ERROR_EXIT) from None
    finally:
        if "LOCAL_RANK" not in env_before:  # the job's launcher, not one of its child ranks
            _reset_job_state(env_before)


def _main() -> None:
    argv = sys.argv[1:]
    try:
        precheck(argv)
    except config_checks.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(_ERROR_EXIT) from None
    _hydra_main()


def main() -> None:
    """Console entry point: run the app and exit without the gloo shutdown abort."""
    run_main(_main)


if __name__ == "__main__":
    main()
