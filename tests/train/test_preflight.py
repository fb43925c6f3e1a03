"""The pre-flight (toolkit/train/preflight.py): every check that can refuse a run (optional packages,
memory, zero.nvme_path, checkpoint and swap-file disk space) runs before any kernel build, model,
swap file or data, says every problem at once (exit 2), leaves no run directory behind, and through
the real CLI answers in seconds without loading torch. `toolkit validate` says the same verdicts as
warnings and still exits 0."""
import shutil
import time

import pytest

from tests.conftest import run_cli
from toolkit.errors import UserError
from toolkit.observe.disk_fit import checkpoint_bytes, estimated_parameters, swap_bytes
from toolkit.recipe.load import load_recipe

NVME = ["zero.stage=3", "zero.offload_optimizer=nvme", "training.device=cpu"]
HUGE = "model.n_layer=10000000"  # terabytes of states and activations: no test machine holds it


@pytest.fixture
def nothing_slow_may_start(monkeypatch):
    """Kernel builds, model construction, swap folders and files, and data building raise if reached."""
    def tripwire(what):
        def trip(*args, **kwargs):
            raise AssertionError(f"{what} started before the pre-flight refused")
        return trip

    monkeypatch.setattr("toolkit.ops.loader.resolve", tripwire("a kernel build"))
    monkeypatch.setattr("toolkit.ops.loader.load_extension", tripwire("a kernel build"))
    monkeypatch.setattr("toolkit.runtime.engine.build_model", tripwire("model construction"))
    monkeypatch.setattr("toolkit.runtime.zero.swap.SwapDir.__init__", tripwire("a swap folder"))
    monkeypatch.setattr("toolkit.runtime.zero.swap.SwapFile.__init__", tripwire("a swap-file reservation"))
    monkeypatch.setattr("toolkit.train.loop.Dataset", tripwire("data building"))


def _disk_with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))


def _run(overrides, run_dir):
    from toolkit.train.loop import run

    return run(load_recipe("quickstart", overrides), run_dir=run_dir, quiet=True)


def test_swap_files_and_a_checkpoint_that_fit_one_at_a_time_but_not_together_are_refused_before_anything_slow(
        tmp_path, monkeypatch, nothing_slow_may_start):
    # NOTE: the H200 case: 58 GiB of swap files reserved, then no room for the checkpoint on the same disk.
    swap = tmp_path / "swap"
    swap.mkdir()
    overrides = [*NVME, f"zero.nvme_path={swap}"]
    recipe = load_recipe("quickstart", overrides)
    params = estimated_parameters(recipe)
    checkpoint, swapped = checkpoint_bytes(params), swap_bytes(recipe, params, 1)
    assert checkpoint > 0 and swapped > 0
    _disk_with_free(monkeypatch, max(checkpoint, swapped) + 1)
    with pytest.raises(UserError) as refused:
        _run(overrides, tmp_path / "run")
    [line] = refused.value.lines
    assert line.startswith(f"recipe.zero.nvme_path: {swap}: on the same disk as the checkpoints "
                           f"({tmp_path / 'run' / 'checkpoints'}), ")
    assert "the swap files need" in line and "together" in line and "--run-dir" in line
    assert not (tmp_path / "run").exists() and list(swap.iterdir()) == []


def test_every_problem_is_said_at_once_in_the_pre_flights_order(tmp_path, monkeypatch, nothing_slow_may_start):
    monkeypatch.setattr("toolkit.optional_packages.is_installed", lambda module: module != "tensorboard")
    _disk_with_free(monkeypatch, 10**6)
    missing = tmp_path / "no-such-folder"
    with pytest.raises(UserError) as refused:
        _run([*NVME, HUGE, f"zero.nvme_path={missing}", "logging.tensorboard=true"], tmp_path / "run")
    packages, memory, folder, checkpoint = refused.value.lines
    assert packages.startswith("recipe.logging.tensorboard true: needs the package 'tensorboard'")
    assert memory.startswith("recipe: too big for this machine: ") and "model.n_layer 10000000" in memory
    assert folder == f"recipe.zero.nvme_path: {missing}: no such folder (make it, on a fast local disk)"
    assert checkpoint.startswith(f"{tmp_path / 'run' / 'checkpoints'}: 0.00 GB free, but a checkpoint of ")
    assert not (tmp_path / "run").exists()


def _one_error(proc, started: float) -> str:
    assert time.perf_counter() - started < 15, "the refusal took longer than a start-up"
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ")
    return line


@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one-process", "launcher"])
def test_run_refuses_a_missing_nvme_path_in_seconds_before_torch_loads(nproc, no_torch, tmp_path):
    started = time.perf_counter()
    missing = tmp_path / "no-such-folder"
    line = _one_error(run_cli("run", "quickstart", *NVME, f"zero.nvme_path={missing}", "--run-dir",
                              str(tmp_path / "run"), *nproc, timeout=60), started)
    assert line == f"error: recipe.zero.nvme_path: {missing}: no such folder (make it, on a fast local disk)"
    assert not (tmp_path / "run").exists()


def test_run_refuses_a_checkpoint_larger_than_the_disk_in_seconds_before_torch_loads(no_torch, tmp_path):
    started = time.perf_counter()
    line = _one_error(run_cli("run", "quickstart", HUGE, "training.memory_check=off", "training.device=cpu",
                              "--run-dir", str(tmp_path / "run"), timeout=60), started)
    assert line.startswith(f"error: {tmp_path / 'run' / 'checkpoints'}: ") and " GB free, but a checkpoint of " in line
    assert not (tmp_path / "run").exists()


def test_validate_warns_in_one_line_naming_the_keys_when_the_recipe_does_not_fit_this_machine():
    proc = run_cli("validate", "quickstart", "model.n_embd=65536", "training.device=cpu", "checkpoint.save_final=false",
                   timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("quickstart: valid")
    [line] = proc.stderr.splitlines()
    assert line.startswith("warning: recipe: too big for this machine: needs about ")
    assert "model states" in line and "model.n_embd 65536" in line and "zero.stage 0" in line


def test_validate_warns_when_the_checkpoint_and_swap_files_do_not_fit_the_disk(tmp_path, monkeypatch, capsys):
    from toolkit.cli.main import main

    swap = tmp_path / "swap"
    swap.mkdir()
    _disk_with_free(monkeypatch, 1000)
    assert main(["validate", "quickstart", *NVME, f"zero.nvme_path={swap}"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("quickstart: valid")
    [line] = err.splitlines()
    assert line.startswith(f"warning: recipe.zero.nvme_path: {swap}: on the same disk as the checkpoints "
                           "(runs/quickstart-<timestamp>/checkpoints), 1000 B free, but the swap files need ")
    assert main(["validate", "quickstart", *NVME, f"zero.nvme_path={tmp_path / 'gone'}"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"warning: recipe.zero.nvme_path: {tmp_path / 'gone'}: no such folder (make it, on a fast local disk)",
        "warning: runs/quickstart-<timestamp>/checkpoints: 0.00 GB free, but a checkpoint of "
        f"{estimated_parameters(load_recipe('quickstart')):,} parameters takes about 0.00 GB (12 bytes each: fp32 "
        "weights and AdamW's two moments); free space or choose another --run-dir"]


def test_validate_says_nothing_more_for_a_recipe_that_fits():
    proc = run_cli("validate", "quickstart", timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def _rank_main(rank, world, port, out_dir):
    import json

    from tests.conftest import become_rank

    become_rank(rank, world, port)
    if rank == 1:  # this rank's disk is full: every rank stops, only this one says why
        shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000)
    try:
        _run(["training.device=cpu"], out_dir / "run")
        lines = None
    except UserError as exc:
        lines = exc.lines
    (out_dir / f"rank{rank}.json").write_text(json.dumps(lines))


@pytest.mark.dist
def test_a_refusal_on_one_rank_stops_every_rank_before_anything_slow(tmp_path):
    import json

    import torch.multiprocessing as mp

    import toolkit.train.loop  # noqa: F401  (forked ranks inherit the import)
    from tests.conftest import free_port

    mp.start_processes(_rank_main, args=(2, free_port(), tmp_path), nprocs=2, join=True, start_method="fork")
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    params = estimated_parameters(load_recipe("quickstart", world_size=2))
    assert said[0] == [] and said[1] == [f"{tmp_path / 'run' / 'checkpoints'}: 0.00 GB free, but a checkpoint of "
                                         f"{params:,} parameters takes about 0.00 GB (12 bytes each: fp32 weights and "
                                         "AdamW's two moments); free space or choose another --run-dir"]
    assert not (tmp_path / "run").exists()
