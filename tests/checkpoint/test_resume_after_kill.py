"""Exact resume after a real kill: 20 uninterrupted steps vs a run SIGKILLed
after step 10 (checkpoints every 5 steps), then `toolkit run` again (resume:
auto) to step 20; per-step losses bitwise equal, in fp32 and in bf16 on the CPU."""
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO

RECIPE = ["training.max_steps=20", "checkpoint.interval=5", "training.log_interval=1", "training.eval_batches=0",
          "scheduler.warmup_num_steps=2", "data.num_samples=512", "model.dropout=0.1"]


def _toolkit(run_dir, dtype):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "toolkit", "run", "quickstart", "--run-dir", str(run_dir),
                             f"precision.dtype={dtype}", *RECIPE], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["loss"]) for m in lines if "loss" in m]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sigkill_after_step_10_then_resume_matches_20_straight_steps_bitwise(tmp_path, dtype):
    straight = _toolkit(tmp_path / "straight", dtype)
    killed_dir = tmp_path / "killed"
    victim = _toolkit(killed_dir, dtype)
    for line in victim.stdout:               # the console prints one line per step
        if line.startswith("step") and "/20 |" in line and int(line.split()[1].split("/")[0]) >= 11:
            victim.send_signal(signal.SIGKILL)
            break
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert (killed_dir / "checkpoints" / "step-000010").is_dir()
    assert not (killed_dir / "checkpoints" / "step-000020").exists()  # killed before the end

    resumed = _toolkit(killed_dir, dtype)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    out_straight, err_straight = straight.communicate(timeout=300)
    assert straight.returncode == 0, err_straight
    # NOTE: bitwise: same CPU, same ops in the same order, restored RNG and data position.
    assert _losses(killed_dir) == _losses(tmp_path / "straight")
    assert [s for s, _ in _losses(killed_dir)] == list(range(1, 21))
