"""training.cpu_threads: auto picks one thread for a model too small to split, the usable
cores shared among local ranks for a larger one, and respects OMP_NUM_THREADS; an
integer sets it; the start-up table shows the choice and why; `toolkit.initialize`
applies it too."""
import os

import pytest

from tests.conftest import run_cli
from toolkit.runtime import cpu_threads
from toolkit.runtime.cpu_threads import set_openmp_wait_policy
from toolkit.train.recipe_threads import choose_cpu_threads
from toolkit.recipe.load import load_recipe


@pytest.fixture
def machine(monkeypatch):
    """machine(cores, local_ranks): pretend this process may run on `cores` CPUs, no OMP_NUM_THREADS set."""
    def make(cores: int, local_ranks: int = 1) -> None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
        monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
    return make


def test_auto_gives_a_tiny_model_one_thread(machine):
    machine(16)
    choice = choose_cpu_threads(load_recipe("quickstart"))
    assert choice.count == 1 and "0.74 GFLOP per micro batch" in choice.reason


def test_auto_shares_the_usable_cores_among_local_ranks_for_a_larger_model(machine):
    machine(16, local_ranks=4)
    choice = choose_cpu_threads(load_recipe("gpt2-124m"))
    assert choice.count == 4 and choice.reason == "auto: 16 usable cores / 4 ranks"


def test_auto_respects_omp_num_threads_and_an_integer_wins(machine, monkeypatch):
    machine(16)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_cpu_threads(load_recipe("gpt2-124m")) == cpu_threads.ThreadChoice(3, "OMP_NUM_THREADS")
    assert choose_cpu_threads(load_recipe("quickstart", ["training.cpu_threads=2"])).count == 2


@pytest.fixture
def torch_threads():
    """Restores torch's intra-op thread count after the test."""
    import torch

    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


def test_initialize_applies_the_recipes_thread_choice_and_leaves_a_users_model_alone_on_auto(machine, torch_threads):
    from toolkit import initialize

    machine(2)
    torch = torch_threads
    torch.set_num_threads(2)
    initialize(load_recipe("quickstart"))  # auto: the tiny model gets one thread, as under `toolkit run`
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))
    initialize(load_recipe("quickstart"), model=model)  # auto would size by the recipe's model, not this one
    assert torch.get_num_threads() == 2
    initialize(load_recipe("quickstart", ["training.cpu_threads=1"]), model=model)  # a count is a count
    assert torch.get_num_threads() == 1


def test_the_cli_makes_idle_openmp_threads_sleep_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    set_openmp_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    set_openmp_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("setting, row", [
    (None, "threads   | 1 torch thread (auto: 0.74 GFLOP per micro batch is too little to split;"),
    ("2", "threads   | 2 torch threads (training.cpu_threads)"),
])
def test_startup_table_shows_the_thread_choice(monkeypatch, tmp_path, setting, row):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    overrides = ["training.max_steps=2", "scheduler.warmup_num_steps=1", "training.eval_batches=0",
                 "checkpoint.save_final=false"] + ([f"training.cpu_threads={setting}"] if setting else [])
    proc = run_cli("run", "quickstart", *overrides, "--run-dir", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert row in proc.stdout


def test_a_thread_count_below_one_is_one_line():
    proc = run_cli("validate", "quickstart", "training.cpu_threads=0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: recipe.training.cpu_threads: 0 is less than the minimum of 1"


def test_a_thread_count_openmp_cannot_start_is_one_line():
    proc = run_cli("validate", "quickstart", "training.cpu_threads=20000")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: recipe.training.cpu_threads: 20000 is greater than the maximum of 1024"
