"""A short gloo DDP run, ended as a plain script, through ``run_main``, or armed at exit.

``python -m tests.helpers.exit_probe {plain|clean|armed} RANK WORLD_SIZE PORT``: three DDP
training steps on a linear model. ``plain`` then calls ``destroy_process_group()`` and lets the
interpreter finalize, as the usual scripts do (the gloo abort at exit can strike); ``clean`` leaves
through :func:`ddp_plugins.core.run_main`, as every ddp_plugins entry point does; ``armed`` returns
to an entry point that is not ours after :func:`ddp_plugins.core.process.exit_at_interpreter_exit`,
as the app does inside a submitit task.
"""

import os
import sys

import torch
import torch.distributed as dist


def _work(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()


if __name__ == "__main__":
    mode, rank, world_size, port = sys.argv[1], *map(int, sys.argv[2:5])
    if mode == "clean":
        from ddp_plugins.core import run_main

        run_main(lambda: _work(rank, world_size, port))
    elif mode == "armed":
        from ddp_plugins.core.process import exit_at_interpreter_exit

        _work(rank, world_size, port)
        exit_at_interpreter_exit(0)
    else:
        _work(rank, world_size, port)
        dist.destroy_process_group()
