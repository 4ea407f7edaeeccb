"""The timeline of steps and reported collectives, straggler blame and the Chrome trace (raw torch DDP, gloo).

Plain torch: no Lightning. The callback is tested in tests/lightning/test_comm_timeline.py.
"""

import json
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_plugins.core import convert_sync_batchnorm, distributed_concat
from ddp_plugins.core.timeline import TimedCommHook, Timeline, collective_kind
from tests.helpers.straggler import assert_blamed_for_slow_steps_only

STEPS = 80
SLOW_EVERY = 4  # rank 1 sleeps in its "data loader" before every 4th step: a quarter of the steps
SLEEP_S = 0.05
# blame threshold: well under the injected delay, above the scheduling jitter of a shared 2-core machine
# (the 5 ms default is for nodes that run nothing else)
BLAME_THRESHOLD_S = 0.02


def _net():
    torch.manual_seed(0)
    return convert_sync_batchnorm(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)))


def _train(timeline, model, rank, steps, slow_every, collect_every=20):
    """SGD steps on random rows; rank 1 sleeps before the steps ``step % slow_every == 1``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    blamed, reports = {}, []
    for step in range(steps):
        if rank == 1 and slow_every and step % slow_every == 1:
            time.sleep(SLEEP_S)  # a slow data loader on rank 1
        x = torch.randn(8, 16)
        timeline.begin_step(step)
        with timeline.phase("forward"):
            loss = model(x).square().mean()
        with timeline.phase("backward"):
            loss.backward()
        with timeline.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        timeline.end_step()
        if (step + 1) % collect_every == 0:
            report = timeline.collect()
            blamed.update(report["blamed"])
            reports.append(report)
    return blamed, reports


def _test_straggler(rank, world_size):
    timeline = Timeline(blame_threshold_s=BLAME_THRESHOLD_S)
    offset, residual = timeline.sync_clocks()
    model = DistributedDataParallel(_net())
    model.register_comm_hook(None, timeline.comm_hook())
    timeline.time_buffer_broadcast(model)
    blamed, reports = _train(timeline, model, rank, STEPS, SLOW_EVERY)
    return blamed, reports, timeline.summary(), offset, residual


def test_a_rank_slowed_in_a_quarter_of_the_steps_is_blamed_for_those_steps_only(dist_pool):
    results = dist_pool.run(_test_straggler)
    blamed, reports, summary, _, _ = results[0]
    assert blamed == results[1][0], "every rank derives the same blame from the gathered records"
    assert_blamed_for_slow_steps_only(blamed, STEPS, SLOW_EVERY)
    assert summary["slowest_rank"] == 1
    # order and causality, not wall-clock margins (a loaded machine stretches any time): the excess
    # is the slow rank's, it is positive, and the other rank's score stays below its
    assert summary["excess_ms_per_step"] > 0, summary
    assert reports[-1]["scores"][1] > reports[-1]["scores"][0]
    assert summary["steps"] == STEPS
    assert set(summary["comm_share"]) == {"ddp_bucket", "ddp_buffers"}, summary
    # rank 0 waits for the slow rank in DDP's buffer broadcast, the first collective of each step
    assert reports[0]["wait_ms"] > 0, reports[0]
    for _, _, summary, offset, residual in results:
        # one host: every rank reads the same monotonic clock, so the true offset is 0
        assert abs(offset) <= residual + 1_000_000, (offset, residual)
        assert summary["clock_residual_us"] == round(residual / 1e3, 1)


def _test_trace(rank, world_size, path):
    before = dist.all_reduce
    timeline = Timeline().activate()
    try:
        timeline.sync_clocks()
        model = DistributedDataParallel(_net(), bucket_cap_mb=0.0005)  # several buckets once rebuilt
        model.register_comm_hook(None, TimedCommHook(timeline))
        handles = timeline.time_buffer_broadcast(model)
        _train(timeline, model, rank, 6, 0, collect_every=3)
        timeline.begin_step(6)
        dist.barrier()  # not reported: not recorded
        gathered = distributed_concat(torch.arange(3 + rank))
        with collective_kind("my_metric", "all_reduce"):
            dist.all_reduce(torch.ones(2))
        timeline.end_step()
        timeline.collect()
        if rank == 0:
            timeline.write_chrome_trace(path)
        untouched = dist.all_reduce is before
        ddp = model._get_ddp_logging_data()  # the buckets of the first step, and of the others (rebuilt)
        buckets = len(ddp["bucket_sizes"].split()) + 5 * len(ddp["rebuilt_bucket_sizes"].split())
    finally:
        timeline.deactivate()
    for handle in handles:
        handle.remove()
    with collective_kind("after"):  # no active timeline: nothing recorded
        pass
    labelled = [(r.kind, r.op, r.step) for r in timeline.recent if r.kind in ("gather", "my_metric", "after")]
    return untouched, gathered.tolist(), labelled, buckets


def test_the_trace_is_chrome_trace_json_with_every_rank_and_collective_kind(dist_pool, tmp_path):
    path = tmp_path / "trace.json"
    results = dist_pool.run(_test_trace, str(path))
    for untouched, gathered, labelled, _ in results:
        assert untouched, "torch.distributed.all_reduce is torch's own while a timeline is active"
        assert gathered == [0, 1, 2, 0, 1, 2, 3], "distributed_concat's result, labelled or not"
        assert labelled == [("gather", "distributed_concat", 6), ("my_metric", "all_reduce", 6)], labelled
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for event in events:
        assert {"name", "ph", "pid"} <= set(event), event
        if event["ph"] == "X":
            assert event["dur"] >= 0 and isinstance(event["ts"], float)
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    kinds = {e["name"] for e in events if e.get("cat") == "collective"}
    assert kinds == {"ddp_bucket", "ddp_buffers", "gather", "my_metric"}, kinds
    phases = {e["name"] for e in events if e.get("cat") == "phase"}
    assert phases == {"data_wait", "forward", "backward", "optimizer", "step"}
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert any(e["ph"] == "C" for e in events), "the straggler score is a counter track"
    buckets = [e for e in events if e.get("name") == "ddp_bucket" and e["pid"] == 0]
    assert len(buckets) == results[0][3] > 6, "one record per bucket DDP reduced in _train's 6 steps"
    assert trace["otherData"]["steps"] == 7


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="`score_decay` should be"):
        Timeline(score_decay=0)
    with pytest.raises(TypeError, match="`hook` should be"):
        TimedCommHook(Timeline(), hook=3)
    with pytest.raises(TypeError, match="`kind` should be"):
        collective_kind("").__enter__()
    with pytest.raises(TypeError, match="`model` should be"):
        Timeline().time_buffer_broadcast(nn.Linear(1, 1))


@pytest.mark.gpu
def test_nccl_collectives_are_timed_on_the_gpu_stream_not_when_queued(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    timeline = Timeline().activate()
    try:
        x = torch.randn(4096, 4096, device="cuda")

        def matmuls():
            for _ in range(20):
                y = x @ x
            return y

        torch.cuda.synchronize()
        dist.all_reduce(matmuls())  # warm: cuBLAS, the GPU's clocks and the communicator's first use, untimed below
        torch.cuda.synchronize()
        # what the matmuls take once warm (a cold first run takes several times longer: the first
        # version of this test measured that one, 99 ms against 26.6 ms warm on an H100)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        matmuls()
        end.record()
        end.synchronize()
        matmuls_ns = start.elapsed_time(end) * 1e6
        timeline.begin_step(0)
        queued = timeline.now()
        y = matmuls()  # queued: the stream is busy with them after the host has moved on
        with collective_kind("test", "all_reduce", cuda=True):
            dist.all_reduce(y)
        returned = timeline.now()
        timeline.end_step()
        timeline.collect()
        record = timeline.recent[-1]
        assert record.op == "all_reduce" and record.events is None
        assert returned - queued < 0.5 * matmuls_ns, "the host should not have waited for the matmuls"
        # the stream reached the all_reduce after the matmuls ran, which was after the host had
        # returned from queueing it: the record says so, not the host's clock
        assert record.start_ns > returned, (record.start_ns - returned, matmuls_ns)
        assert record.start_ns - queued > 0.5 * matmuls_ns, (record.start_ns - queued, matmuls_ns)
        assert record.end_ns >= record.start_ns
    finally:
        timeline.deactivate()
        dist.destroy_process_group()
