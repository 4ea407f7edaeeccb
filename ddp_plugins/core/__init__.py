"""The torch-only core: collectives, SyncBatchNorm, samplers and the global plan, comm hooks, the timeline, liveness,
seeding, preemption, checkpoints and the clean exit, for a raw ``torch.distributed`` loop, Fabric, and the adapters."""

from ddp_plugins.core.checkpoints import gather_per_rank, latest_checkpoint
from ddp_plugins.core.checks import (
    ArgumentError,
    ArgumentTypeError,
    ArgumentValueError,
    check_bool,
    check_choice,
    check_int,
    check_number,
)
from ddp_plugins.core.collectives import distributed_concat
from ddp_plugins.core.comm_hooks import COMM_HOOKS, CountingCommHook, build_comm_hook, check_comm_hook
from ddp_plugins.core.files import save_atomic
from ddp_plugins.core.liveness import Liveness, Record, Verdict, judge
from ddp_plugins.core.plan import EmptyShareCollate, EvenSteps, GlobalPlan, PlanBatchSampler
from ddp_plugins.core.preemption import (
    Preempted,
    SignalAgreement,
    SignalFlag,
    agree_on_signal,
    slurm_requeue,
    stable_run_name,
)
from ddp_plugins.core.process import exit_process, run_main
from ddp_plugins.core.ranks import (
    collective_device,
    for_collective,
    get_rank,
    get_world_size,
    rank_zero_first,
    setup_rank_logging,
)
from ddp_plugins.core.reproducible import ShardedStep, exact_sum, fingerprint, shard_seed
from ddp_plugins.core.samplers import PaddingApartSampler, ResumableSampler, SequentialDistributedSampler
from ddp_plugins.core.seeding import (
    collect_rng_states,
    decode_rng_states,
    encode_rng_states,
    rank_seed,
    seed_everything_rank_aware,
    set_rng_states,
)
from ddp_plugins.core.sync_batchnorm import (
    SyncBatchNorm,
    SyncBatchNormReport,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from ddp_plugins.core.sync_batchnorm_function import SyncBatchNormFunction, sync_batch_norm
from ddp_plugins.core.timeline import TimedCommHook, Timeline, collective_kind
from ddp_plugins.core.workers import WorkerInit, seed_worker

__all__ = [
    "Liveness",
    "Record",
    "Verdict",
    "agree_on_signal",
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "judge",
    "build_comm_hook",
    "check_bool",
    "check_choice",
    "check_comm_hook",
    "check_int",
    "check_number",
    "collect_rng_states",
    "collective_device",
    "collective_kind",
    "COMM_HOOKS",
    "convert_sync_batchnorm",
    "CountingCommHook",
    "decode_rng_states",
    "distributed_concat",
    "EmptyShareCollate",
    "encode_rng_states",
    "EvenSteps",
    "exact_sum",
    "exit_process",
    "fingerprint",
    "for_collective",
    "gather_per_rank",
    "get_rank",
    "get_world_size",
    "GlobalPlan",
    "latest_checkpoint",
    "PlanBatchSampler",
    "Preempted",
    "rank_seed",
    "rank_zero_first",
    "ResumableSampler",
    "revert_sync_batchnorm",
    "run_main",
    "save_atomic",
    "seed_everything_rank_aware",
    "seed_worker",
    "PaddingApartSampler",
    "SequentialDistributedSampler",
    "set_rng_states",
    "setup_rank_logging",
    "shard_seed",
    "ShardedStep",
    "SignalAgreement",
    "SignalFlag",
    "slurm_requeue",
    "stable_run_name",
    "sync_batch_norm",
    "SyncBatchNorm",
    "SyncBatchNormFunction",
    "SyncBatchNormReport",
    "TimedCommHook",
    "Timeline",
    "WorkerInit",
]
