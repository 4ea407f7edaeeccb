"""Run ``python -m ddp_plugins.train`` on many command lines, each in a fork of one warm process.

``python -m tests.helpers.bad_cli OUT.json ARGS_JSON``: imports the app once, then for each command
line forks a child that becomes ``python -m ddp_plugins.train ARGS``
(:func:`tests.helpers.warm.start`, which ends through ``exit_process``) in a fresh empty folder
with stdout/stderr captured. This process is a child
subreaper, so a process the app started (a DDP rank) and left behind is re-parented here and is
found. Each result: exit code, stderr, stdout, what the folder holds afterwards, the processes
left behind, and the seconds it took. Forking skips the ~4 s interpreter start per line; the
app's own work (compose, build every object, the Trainer) runs in full for each line.
"""

import ctypes
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time

import ddp_plugins.app.train  # noqa: F401 - what the app imports, once
from ddp_plugins.core.files import write_text_atomic
from tests.helpers import warm

PR_SET_CHILD_SUBREAPER = 36


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as file:
            pids += [int(pid) for pid in file.read().split()]
    return pids


def _run(argv: list[str]) -> dict:
    folder = tempfile.mkdtemp(prefix="ddp_plugins_bad_")
    out_path, err_path = folder + ".out", folder + ".err"
    request = {
        "module": "ddp_plugins.train",
        "args": argv,
        "env": dict(os.environ),
        "cwd": folder,
        "stdout": out_path,
        "stderr": err_path,
    }
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the app, as `python -m ddp_plugins.train ARGV` would run it, in its own folder
        warm.start(functools.partial(warm.become, request, zygote=False))  # a rank it starts: fresh
    _, status = os.waitpid(pid, 0)
    elapsed = time.monotonic() - start
    left = _children()
    for child in left:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    with open(out_path) as out, open(err_path) as err:
        result = {"argv": argv, "code": os.waitstatus_to_exitcode(status), "stdout": out.read(), "stderr": err.read()}
    result.update(files=sorted(os.listdir(folder)), left_behind=left, seconds=elapsed)
    shutil.rmtree(folder)
    os.remove(out_path)
    os.remove(err_path)
    return result


def main() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    out, lines = sys.argv[1], json.loads(sys.argv[2])
    results = [_run(argv) for argv in lines]
    write_text_atomic(out, json.dumps(results))


if __name__ == "__main__":
    main()
