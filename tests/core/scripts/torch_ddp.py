"""A plain torch DDP loop on the core (what docs/plugins.md shows), started by torchrun or Fabric.

``python -m torch.distributed.run --nproc-per-node=2 tests/core/scripts/torch_ddp.py OUT [fabric]``
trains a small BatchNorm net for 3 steps on a contiguous shard of a global batch of 16 rows, with
SyncBN conversion, per-rank seeding and an ordered gathered evaluation, and rank 0 saves what the
test compares with one process. With ``DDP_PLUGINS_BLOCK_LIGHTNING=1`` every Lightning import
fails, to prove the core needs none. With ``fabric`` as the second argument, Lightning Fabric
starts the ranks and wraps the model instead of torchrun and ``DistributedDataParallel``.
"""

import os
import sys

if os.environ.get("DDP_PLUGINS_BLOCK_LIGHTNING") == "1":

    class _NoLightning:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities"):
                raise ImportError(f"{name} is blocked: the core must not need Lightning")
            return None

    sys.meta_path.insert(0, _NoLightning())

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddp_plugins.core import (
    SequentialDistributedSampler,
    convert_sync_batchnorm,
    distributed_concat,
    run_main,
    save_atomic,
    seed_everything_rank_aware,
)

GLOBAL_BATCH, STEPS, EVAL_ROWS = 16, 3, 13


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(STEPS, GLOBAL_BATCH, 4, generator=gen),
        torch.randn(STEPS, GLOBAL_BATCH, 1, generator=gen),
        torch.randn(EVAL_ROWS, 4, generator=gen),
    )


def main() -> None:
    out, use_fabric = sys.argv[1], sys.argv[2:] == ["fabric"]
    net = convert_sync_batchnorm(make_net())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    if use_fabric:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
        fabric.launch()
        model, optimizer = fabric.setup(net, optimizer)
        backward = fabric.backward
    else:
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(net)
        backward = torch.Tensor.backward
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed_everything_rank_aware(7)  # a distinct stream per rank
    noise = torch.rand(3)
    x, y, x_eval = make_data()
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    for step in range(STEPS):
        optimizer.zero_grad()
        backward(F.mse_loss(model(x[step, rows]), y[step, rows]))
        optimizer.step()
    net.eval()
    with torch.no_grad():
        sampler = SequentialDistributedSampler(range(EVAL_ROWS), num_replicas=world_size, rank=rank)
        preds = net(x_eval[list(sampler)])
    gathered = distributed_concat({"preds": preds, "ids": [f"row{i}" for i in sampler]}, EVAL_ROWS)
    noises = distributed_concat(noise[None], None)
    if rank == 0:
        save_atomic({"state": net.state_dict(), "eval": gathered, "noises": noises}, out)


if __name__ == "__main__":
    run_main(main)
