"""The app on one GPU, as `make train` runs it there: 1 rank on nccl, the default callbacks.

Marked `gpu` (`make gpu-check`). In bf16-mixed and in 16-mixed (a GradScaler in the checkpoint), each
precision runs three times through a fresh ``python -m ddp_plugins.train``: an uninterrupted run, which
must reach 0.95; the same run stopped by a SIGTERM in the middle of an epoch, which must exit 143
with a checkpoint; and the same command again, which must resume and end bit-identical to the
uninterrupted run (parameters, BatchNorm buffers, optimizer and scaler state, metrics rows).
``trainer.deterministic=warn``: bit-identical resumes on CUDA need deterministic kernels (cuDNN's
included); "warn" rather than the app's strict ``deterministic=true``, because the demo CNN's global
average pooling has no CUDA backward that torch calls deterministic (each input gets one gradient
there, so it is in fact). Each run prints one summary line (pytest's ``-rA`` shows them).
"""

from __future__ import annotations

import re
import sys

import pytest

from ddp_plugins.testing import check_ok, loopback_env, run_command
from tests.app.test_preemption import _interrupt
from tests.helpers.runs import assert_equal_states, final_state, metrics_rows

pytestmark = pytest.mark.gpu
ACCURACY = re.compile(r"final validation accuracy: ([0-9.]+)")
RUN = [sys.executable, "-m", "ddp_plugins.train", "trainer.enable_progress_bar=false", "+trainer.deterministic=warn",
       "trainer.max_epochs=3"]  # fmt: skip  # 45 steps per epoch on 1 rank; 2 epochs reached 0.9889 on an H100


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_one_gpu_reaches_095_and_a_sigterm_resumes_bit_identical(precision, tmp_path):
    env = loopback_env(CUBLAS_WORKSPACE_CONFIG=":4096:8")
    args = [*RUN, f"precision={precision}"]
    reference = tmp_path / "reference"
    run = check_ok(run_command([*args, f"hydra.run.dir={reference}", "resume=never"], timeout=600, env=env))
    accuracy = float(ACCURACY.search(run.stdout).group(1))
    said = run.stdout + run.stderr
    assert "used: True" in said and "distributed_backend=nccl" in said, (
        f"not 1 rank on nccl on the GPU:\n{said[-3000:]}"
    )
    assert accuracy >= 0.95, f"{precision} on 1 GPU reached {accuracy:.4f}:\n{run.stdout[-2000:]}"

    folder = tmp_path / "interrupted"
    stop = [*_interrupt("train_batch_end", 60, 0, "SIGTERM", "self"), "callbacks.preemption.check_every_n_steps=1"]
    stopped_args = [*args, f"hydra.run.dir={folder}", *stop]  # the stop at step 61, whatever the GPU's speed
    stopped = run_command(stopped_args, timeout=600, env=env)
    assert stopped.returncode == 143, f"exit {stopped.returncode}, expected 143:\n{stopped.stderr[-3000:]}"
    assert list((folder / "checkpoints").glob("step-*-preempted.ckpt")), "the SIGTERM left no checkpoint"
    resumed = check_ok(run_command(stopped_args, timeout=600, env=env))
    assert "resuming from" in resumed.stdout, resumed.stdout[-2000:]
    assert_equal_states(final_state(reference), final_state(folder))
    assert metrics_rows(folder) == metrics_rows(reference)
    print(f"app on 1 GPU, {precision}: accuracy {accuracy:.4f}; SIGTERM at step 60 (exit 143), resumed bit-identical")
