"""Multi-process runs through the real CLI: `toolkit run --nproc 2` (ZeRO-2, saving
sharded checkpoints), then `torchrun --nproc_per_node 2 -m toolkit run` resuming the
same run directory under ZeRO-3; `toolkit export` consolidates the shards. Plus the
launcher's user errors and `toolkit doctor`."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO, run_cli

OVERRIDES = ["training.max_steps=8", "training.log_interval=1", "training.eval_interval=0", "scheduler.type=constant",
             "data.num_samples=512", "checkpoint.interval=4", "checkpoint.keep_last=3"]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory):
    import subprocess

    run_dir = tmp_path_factory.mktemp("zero-cli") / "run"
    first = run_cli("run", "quickstart", "--nproc", "2", "--run-dir", str(run_dir), "zero.stage=2", *OVERRIDES)
    assert first.returncode == 0, first.stderr[-3000:]
    metrics_first = read_jsonl(run_dir / "metrics.jsonl")
    # the same run directory, two more checkpoints' worth of steps, resumed by torchrun under stage 3
    env_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "toolkit", "run", "quickstart", "--run-dir", str(run_dir), "zero.stage=3",
               *[o.replace("max_steps=8", "max_steps=12") for o in OVERRIDES]]
    import os
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    second = subprocess.run(env_cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    return run_dir, first, second, metrics_first


@pytest.mark.dist
def test_nproc_run_logs_once_and_saves_one_shard_per_rank(two_launches):
    run_dir, first, _, metrics = two_launches
    assert first.stdout.count("done: 8 steps") == 1  # rank 0 alone prints
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 9))
    assert "world 2" in first.stdout
    if "OMP_NUM_THREADS" not in os.environ:  # the launcher leaves the choice to each rank's 'auto'
        assert "threads   | 1 torch thread (auto: " in first.stdout
    step4 = run_dir / "checkpoints" / "step-000004"
    assert sorted(p.name for p in step4.glob("zero-rank-*")) == ["zero-rank-00000-of-00002.safetensors",
                                                                 "zero-rank-00001-of-00002.safetensors"]
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert "zero-rank-00001-of-00002.safetensors" in manifest["files"]


@pytest.mark.dist
def test_torchrun_resumes_the_run_under_another_stage(two_launches):
    run_dir, _, second, first_metrics = two_launches
    assert "resume" in second.stdout and "step 8 of 12" in second.stdout
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert metrics[:8] == [m for m in first_metrics if "loss" in m]
    assert metrics[-1]["loss"] < metrics[0]["loss"]


@pytest.mark.dist
def test_export_consolidates_zero_shards(two_launches, tmp_path):
    from safetensors.torch import load_file

    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint
    from toolkit.checkpoint.zero_shards import consolidated_model_state

    run_dir = two_launches[0]
    proc = run_cli("export", str(run_dir), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ckpt = load_checkpoint(find_checkpoint(run_dir))
    assert ckpt.step == 12
    whole = consolidated_model_state(ckpt.state["engine"], ckpt.path)
    for name, tensor in exported.items():
        assert torch.equal(tensor, whole[name]), name


def test_nproc_with_a_bad_recipe_is_one_line_before_any_launch(tmp_path):
    proc = run_cli("run", "quickstart", "--nproc", "3", "batch.global_batch=16", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: recipe.batch: global_batch 16 != micro_batch_per_rank 16 x grad_accum_steps 1 x world size 3 = 48; "
        "set batch.global_batch to 48"]
    assert not (tmp_path / "r").exists()


def test_world_size_mismatch_is_a_user_error(monkeypatch):
    from toolkit.errors import UserError
    from toolkit.distributed import init_distributed

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UserError, match="resolved for 2 rank"):
        init_distributed(2, torch.device("cpu"))


def test_doctor_reports_backends_and_the_cpu_adam_kernel():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "gloo yes" in proc.stdout
    assert "cpu_adam" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.split()[:1] == ["cpu_adam"])
    assert line.split()[1] in ("loaded:", "not", "unavailable:"), line  # loaded, not built, unavailable
    assert "building" not in proc.stderr  # doctor builds nothing


def test_stage3_with_compile_is_a_one_line_user_error(tmp_path):
    proc = run_cli("run", "quickstart", "zero.stage=3", "training.compile=true", "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: recipe.training.compile: not with zero.stage 3")


def test_nproc_below_one_is_one_line_naming_the_option():
    proc = run_cli("run", "quickstart", "--nproc", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --nproc 0: must be at least 1"
