"""The app's Hydra command lines: config flags, quoted overrides, and a child rank's command."""

from __future__ import annotations

import sys

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_original_cwd, to_absolute_path

from ddp_plugins import _compat

__all__ = ["hydra_quote", "job_subprocess_cmd", "split_config_flags"]

_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def split_config_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split Hydra's config-selection flags (``--config-name x``, ``-cd=x``, ...) from the rest.

    Returns:
        The flags, each as ``[flag, value]`` pairs flattened, and every other argument.

    Example::

        >>> split_config_flags(["--config-name", "mine", "backend=gloo", "-cd=/etc/conf"])
        (['--config-name', 'mine', '-cd', '/etc/conf'], ['backend=gloo'])
    """
    flags: list[str] = []
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, has_value, value = arg.partition("=")
        if name in _CONFIG_FLAGS:
            flags += [name, value if has_value else next(args, "")]
        else:
            rest.append(arg)
    return flags, rest


def hydra_quote(value: str) -> str:
    """``value`` as a single-quoted Hydra override value, so quotes and spaces in a path survive.

    Example::

        >>> print(hydra_quote('runs/we"ird'))
        'runs/we"ird'
    """
    return "'" + value.replace("'", "\\'") + "'"


def job_subprocess_cmd(local_rank: int) -> tuple[list[str], str | None]:
    """The command and folder that start child rank ``local_rank`` of this Hydra job (the strategy's ``child_command``).

    Lightning's own would re-run the whole command line (a sweep under ``--multirun``); outside Hydra it is used."""
    if not HydraConfig.initialized():
        return _compat.subprocess_cmd(local_rank)
    import __main__  # here: the module `python -m` or a warm start made __main__, not the one at import

    hydra_cfg = HydraConfig.get()
    spec = __main__.__spec__
    script = [to_absolute_path(sys.argv[0])] if spec is None else ["-m", spec.name]
    # the config the user chose, only this job's overrides (no --multirun, no sweep), its own folder
    return [
        sys.executable,
        *script,
        *split_config_flags(sys.argv[1:])[0],
        *hydra_cfg.overrides.task,
        f"hydra.run.dir={hydra_quote(hydra_cfg.runtime.output_dir)}",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
    ], get_original_cwd()
