"""Many short gloo DDP runs, each ended as a plain script, through ``run_main``, or armed at exit.

``python -m tests.helpers.exit_probe {plain|clean|armed} ROUNDS OUT.json [--stop-at-failure]``:
imports torch and what DDP's constructor imports (``torch._dynamo``) once, then in each round forks two ranks that
meet in a gloo group and run three DDP training steps on a linear model. ``plain`` then calls
``destroy_process_group()`` and returns to the interpreter, which finalizes, as the usual scripts
do (the gloo abort at exit can strike); ``clean`` leaves through :func:`ddp_plugins.core.run_main`,
as every ddp_plugins entry point does; ``armed`` returns to the interpreter after
:func:`ddp_plugins.core.process.exit_at_interpreter_exit`, as the app does inside a submitit task.
OUT.json gets each rank's round, exit code and the end of its stderr.

Why forks: the abort strikes at interpreter exit, after the work, and a forked rank finalizes and
exits as a fresh one does (its process group, gloo threads and store are its own, made after the
fork). Forking skips the ~3 s per process of importing torch and ``torch._dynamo``, so a run
proves many more exits in the same time.
"""

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddp_plugins.core.files import write_text_atomic
from ddp_plugins.core.process import exit_at_interpreter_exit, parent_death_signal, run_main
from ddp_plugins.testing import free_port

WORLD_SIZE = 2
ROUND_TIMEOUT = 60.0


def _work(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()


def _rank(mode: str, rank: int, port: int, stderr: int, dies_with_probe: Callable[[], None] | None) -> None:
    """A forked rank: returns (plain, armed) to let the interpreter finalize, or never (clean)."""
    if dies_with_probe is not None:  # a probe killed at the test's timeout takes its ranks along
        dies_with_probe()
    os.dup2(stderr, 2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    if mode == "clean":
        run_main(lambda: _work(rank, port))
    _work(rank, port)
    if mode == "armed":
        exit_at_interpreter_exit(0)
    else:
        dist.destroy_process_group()


def _wait(ranks: dict[int, int]) -> dict[int, int | None]:
    """Each rank's exit code by pid; None for a rank still running at the round's timeout (killed)."""
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + ROUND_TIMEOUT
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            for hung in set(ranks) - set(codes):
                os.kill(hung, 9)
                os.waitpid(hung, 0)
                codes[hung] = None
        else:
            time.sleep(0.01)
    return codes


def main() -> None:
    """Run the rounds and write OUT.json; a forked rank returns from here to the interpreter."""
    mode, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    stop_at_failure = "--stop-at-failure" in sys.argv[4:]
    torch.compiler.reset()  # imports torch._dynamo, as DDP's constructor would in every rank
    dies_with_probe = parent_death_signal(9)  # made here, called in each rank
    results = []
    for round_ in range(rounds):
        port = free_port()
        ranks, logs = {}, {}
        for rank in range(WORLD_SIZE):
            log = tempfile.TemporaryFile()
            pid = os.fork()
            if pid == 0:
                _rank(mode, rank, port, log.fileno(), dies_with_probe)
                return
            ranks[pid], logs[pid] = rank, log
        for pid, code in _wait(ranks).items():
            logs[pid].seek(0)
            stderr = logs[pid].read().decode(errors="replace").strip()[-300:]
            results.append({"round": round_, "rank": ranks[pid], "code": code, "stderr": stderr})
            logs[pid].close()
        if stop_at_failure and any(r["code"] != 0 for r in results):
            break
    write_text_atomic(out, json.dumps(results))


if __name__ == "__main__":
    main()
