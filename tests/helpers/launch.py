"""A Lightning job started by Lightning's own launcher, for the tests of that launcher.

``python -m tests.helpers.launch module:function OUT_DIR``: calls ``function(OUT_DIR, *args)``
on this rank and saves its return value to ``OUT_DIR/rank{global_rank}.pt`` (written to a
temporary name, then renamed). Lightning's subprocess launcher re-runs this same command for
every child rank. Tests of what a Trainer computes use :func:`ddp_plugins.testing.run_lightning`,
which forks the ranks instead.
"""

import importlib
import pickle
import sys
from pathlib import Path

from ddp_plugins.core import get_rank, run_main, save_atomic


def _main() -> None:
    target, out_dir = sys.argv[1], Path(sys.argv[2])
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    args = pickle.loads((out_dir / "args.pkl").read_bytes())
    result = func(str(out_dir), *args)
    # the process group's rank, or the launcher's LOCAL_RANK/NODE_RANK once the group is gone
    save_atomic(result, out_dir / f"rank{get_rank()}.pt")


if __name__ == "__main__":
    run_main(_main)
