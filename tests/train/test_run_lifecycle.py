"""A run's life in one process, through the real CLI: one run per run directory
(a lock), SIGTERM stops at a step boundary with a checkpoint and one line, write
failures (file-size limit, a file where checkpoints/ goes, a read-only run dir)
are one line naming the file with the earlier checkpoints intact, and a resume
with nothing left to train says so."""
import json
import os
import resource
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_cli, wait_for_step

FAST = ["scheduler.warmup_num_steps=1", "training.log_interval=1", "training.eval_batches=0"]


def _start(run_dir, *overrides, preexec_fn=None):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(run_dir.parent / f"{run_dir.name}.out", "w") as out:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-m", "toolkit", "run", "quickstart", "--run-dir", str(run_dir),
                                 *FAST, *overrides], cwd=REPO, env=env, text=True, stdout=out,
                                stderr=subprocess.PIPE, preexec_fn=preexec_fn)


def _wait_for_step(run_dir, step, proc, timeout=180):
    wait_for_step(run_dir.parent / f"{run_dir.name}.out", step, proc, timeout)


def _steps(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m["step"] for m in lines if "loss" in m]


def _errors(stderr):
    """stderr without the CPU's MFU warning and resume warnings: what the user is told."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("warning:")]


def test_a_second_run_into_a_busy_run_dir_is_refused_in_one_line_and_the_first_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    # NOTE: the first run is long and stopped by SIGTERM, so a slow start of the second cannot find it ended.
    first = _start(run_dir, "training.max_steps=100000", "optimizer.lr=0.001", "checkpoint.interval=0")
    _wait_for_step(run_dir, 3, first)
    second = run_cli("run", "quickstart", "--run-dir", str(run_dir), "optimizer.lr=0.003", *FAST)
    assert second.returncode == 2
    assert _errors(second.stderr) == [
        f"error: {run_dir}: another toolkit run (pid {first.pid}) is writing this run directory; "
        "wait for it to end or choose another --run-dir"]
    assert first.poll() is None  # the refused run touched nothing of the first's
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 143, err
    steps = _steps(run_dir)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3  # every line parses, each step once
    assert json.loads((run_dir / "recipe.json").read_text())["optimizer"]["lr"] == 0.001


def test_a_lock_left_by_a_killed_process_does_not_block_the_next_run(tmp_path):
    from toolkit.errors import UserError
    from toolkit.train.run_dir import RunDirLock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from toolkit.train.run_dir import RunDirLock; "
                               f"RunDirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(UserError, match=f"pid {holder.pid}"):
        RunDirLock(tmp_path).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    RunDirLock(tmp_path).acquire().release()  # the kernel released the dead holder's lock


def test_sigterm_saves_a_checkpoint_says_how_to_resume_and_the_same_command_resumes(tmp_path):
    run_dir = tmp_path / "run"
    victim = _start(run_dir, "training.max_steps=30", "checkpoint.interval=0")
    _wait_for_step(run_dir, 3, victim)
    victim.send_signal(signal.SIGTERM)
    _, err = victim.communicate(timeout=120)
    assert victim.returncode == 143, err
    step = _steps(run_dir)[-1]
    assert _errors(err) == [f"stopped by SIGTERM at step {step} of 30: checkpoint {run_dir}/checkpoints/"
                            f"step-{step:06d}; to resume, run the same command with --run-dir {run_dir}"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{step:06d}"

    resumed = _start(run_dir, "training.max_steps=30", "checkpoint.interval=0")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert f"(step {step} of 30)" in (tmp_path / "run.out").read_text()
    assert _steps(run_dir) == list(range(1, 31))


def test_a_file_named_checkpoints_is_refused_before_training(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder")
    proc = run_cli("run", "quickstart", "--run-dir", str(run_dir), "training.max_steps=20", *FAST)
    assert proc.returncode == 2
    assert _errors(proc.stderr) == [f"error: {run_dir}/checkpoints: is a file, not a directory "
                                    "(recipe.checkpoint.dir); move the file away or set checkpoint.dir to another name"]
    assert "Traceback" not in proc.stderr and not (run_dir / "metrics.jsonl").exists()


def _file_size_limit(limit_bytes):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def test_a_checkpoint_over_the_file_size_limit_is_one_line_and_the_earlier_one_stays_intact(tmp_path):
    from toolkit.checkpoint.files import verify_checkpoint

    run_dir = tmp_path / "run"
    done = run_cli("run", "quickstart", "--run-dir", str(run_dir), "training.max_steps=4", *FAST)
    assert done.returncode == 0, done.stderr
    # the quickstart checkpoint's tensors take 1.5 MB: a 1 MB limit stops the next one mid-write
    proc = _start(run_dir, "training.max_steps=8", "checkpoint.interval=2", preexec_fn=_file_size_limit(10**6))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    [line] = _errors(err)
    assert line.startswith(f"error: checkpoint step 6: {run_dir}/checkpoints/.tmp-step-000006-")
    assert line.endswith(f"/state.safetensors: cannot write: File too large (EFBIG); earlier checkpoint: "
                         f"{run_dir}/checkpoints/step-000004 is intact; free space or fix the permissions, "
                         "then rerun the same command to resume")
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000004"]  # no temp dir left
    assert (ckpts / "latest").read_text().strip() == "step-000004"
    verify_checkpoint(ckpts / "step-000004")


def test_metrics_over_the_file_size_limit_are_one_line_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    # the limit is per file: recipe.json ~2 kB, tokenizer/tokenizer.json ~4.7 kB, each metrics line ~0.2 kB
    proc = _start(run_dir, "training.max_steps=60", preexec_fn=_file_size_limit(6000))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert _errors(err) == [f"error: {run_dir}/metrics.jsonl: cannot write: File too large (EFBIG); free space "
                            "or fix the permissions, then rerun the same command to resume"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_run_dir_is_refused_before_training(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o500)
    try:
        proc = run_cli("run", "quickstart", "--run-dir", str(run_dir), "training.max_steps=3", *FAST)
    finally:
        run_dir.chmod(0o700)
    assert proc.returncode == 2
    assert _errors(proc.stderr) == [f"error: {run_dir}: the run directory is not writable: Permission denied "
                                    "(EACCES); make it writable or choose another --run-dir"]


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux sysfs, where nobody may create folders")
def test_a_run_dir_that_cannot_be_created_is_refused_before_training():
    proc = run_cli("run", "quickstart", "--run-dir", "/sys/toolkit-run", "training.max_steps=3", *FAST)
    assert proc.returncode == 2
    [line] = _errors(proc.stderr)
    assert line.startswith("error: /sys/toolkit-run: the run directory is not writable: ")
    assert "Traceback" not in proc.stderr


def test_no_room_for_one_checkpoint_is_refused_with_the_sizes(tmp_path, monkeypatch):
    import shutil

    from toolkit.errors import UserError
    from toolkit.train.run_dir import check_room_for_checkpoint

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(UserError, match=r"checkpoints: 0.00 GB free, but a checkpoint of 1,000,000 parameters "
                                        r"takes about 0.01 GB \(12 bytes each"):
        check_room_for_checkpoint(tmp_path / "checkpoints", 1_000_000)
    check_room_for_checkpoint(tmp_path / "checkpoints", 80_000)  # 0.96 MB fits in 1 MB


def test_resuming_past_max_steps_is_refused_and_at_max_steps_says_nothing_is_left(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli("run", "quickstart", "--run-dir", str(run_dir), "training.max_steps=4", *FAST)
    assert done.returncode == 0, done.stderr
    assert f"checkpoint | {run_dir}/checkpoints/step-000004" in done.stdout
    recipe_before = (run_dir / "recipe.json").read_text()

    below = run_cli("run", "quickstart", "--run-dir", str(run_dir), "training.max_steps=2", *FAST)
    assert below.returncode == 2
    assert _errors(below.stderr) == [
        f"error: recipe.training.max_steps: 2 is below the step the run resumes from: the checkpoint "
        f"{run_dir}/checkpoints/step-000004 is at step 4; raise training.max_steps to train further, or start "
        "fresh with checkpoint.resume=never (or another --run-dir)"]
    assert "warning: resume from" not in below.stderr  # no "max_steps 4 -> 2" before the refusal
    assert (run_dir / "recipe.json").read_text() == recipe_before

    again = run_cli("run", "quickstart", "--run-dir", str(run_dir), "training.max_steps=4", *FAST)
    assert again.returncode == 0, again.stderr
    assert (f"warning: recipe.training.max_steps: nothing to train: the checkpoint {run_dir}/checkpoints/"
            "step-000004 is at step 4, which is training.max_steps") in again.stderr


def test_resuming_a_two_rank_checkpoint_in_one_process_says_how_to_keep_the_global_batch():
    from toolkit.checkpoint.resume import model_shape, resume_changes
    from toolkit.recipe.load import load_recipe

    saved = load_recipe("quickstart", [], world_size=2)
    meta = {"model_shape": model_shape(saved.model), "recipe": saved.resolved, "global_batch": 32, "world_size": 2}
    [refusal], _ = resume_changes(meta, load_recipe("quickstart", [], world_size=1))
    assert ("to continue at world size 1 with the saved global batch 32, set batch.grad_accum_steps=2; "
            "or start fresh with checkpoint.resume=never") in refusal
    refusals, warnings = resume_changes(meta, load_recipe("quickstart", ["batch.grad_accum_steps=2"], world_size=1))
    assert refusals == [] and "world size 2 -> 1 (same global batch, same samples per step)" in warnings


def test_a_tokenizer_over_the_file_size_limit_is_one_line_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "training.max_steps=3", preexec_fn=_file_size_limit(3000))  # tokenizer.json ~4.7 kB
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert _errors(err) == [f"error: {run_dir}/tokenizer/tokenizer.json: cannot write: File too large (EFBIG); "
                            "free space or fix the permissions, then rerun the same command to resume"]


@pytest.mark.parametrize("blocked", ["recipe.json", "memory.png"])
def test_a_run_file_that_cannot_be_written_is_one_line_naming_it(tmp_path, blocked):
    run_dir = tmp_path / "run"
    (run_dir / blocked).mkdir(parents=True)  # a folder where the file goes: EISDIR
    proc = run_cli("run", "quickstart", "--run-dir", str(run_dir), "training.max_steps=2", *FAST)
    assert proc.returncode == 2
    assert _errors(proc.stderr) == [f"error: {run_dir / blocked}: cannot write: Is a directory (EISDIR); "
                                    "free space or fix the permissions, then rerun the same command to resume"]
    assert "Traceback" not in proc.stderr


def test_a_stop_during_start_up_passes_through_handlers_that_catch_every_error(tmp_path):
    from toolkit.train.stop import RunStopped

    # NOTE: a kernel build falls back on `except Exception`; a SIGTERM then must still stop the run.
    with pytest.raises(RunStopped):
        try:
            raise RunStopped(signal.SIGTERM, tmp_path, None, 10, why="no step was trained")
        except Exception:
            pytest.fail("a broad handler swallowed the stop")
