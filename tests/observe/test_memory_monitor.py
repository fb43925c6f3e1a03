"""Runtime memory monitor: model-state bytes counted from tensors agree with the
analytic estimator, shared storage counts once, an engine may report its own bytes
(ZeRO shards), and a run logs the memory fields, prints a summary and writes memory.png."""
import json
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.conftest import REPO, run_cli
from toolkit.data.batches import BatchStream, Dataset
from toolkit.runtime.engine import Engine
from toolkit.observe.estimate import estimate_model_state_bytes, format_bytes, parameter_count
from toolkit.observe.memory_monitor import MemoryMonitor, StateBytes, count_model_state_bytes, model_state_bytes
from toolkit.recipe.load import load_recipe

TINY = ["training.max_steps=6", "data.num_samples=256", "scheduler.type=constant"]
MEMORY_FIELDS = {"mem_params_bytes", "mem_grads_bytes", "mem_optim_bytes", "mem_master_bytes", "mem_peak_bytes",
                 "rss_bytes"}


def train_steps(recipe, steps):
    engine = Engine(recipe)
    monitor = MemoryMonitor(engine)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)
    for _ in range(steps):
        engine.train_batch(stream.next_step())
    return engine, monitor


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_measured_model_state_bytes_match_the_estimator_within_5_percent(family):
    recipe = load_recipe("quickstart", [*TINY, f"model.family={family}"])
    engine, monitor = train_steps(recipe, 2)
    measured = monitor.window_metrics(engine.global_step)
    estimate = estimate_model_state_bytes(parameter_count(recipe.model), stage=0, world_size=1, dtype="fp32")
    # fp32, stage 0: 4P parameters, 4P gradients, 8P Adam moments; no separate master copy.
    assert measured["mem_master_bytes"] == 0
    pairs = [(measured["mem_params_bytes"], estimate.params), (measured["mem_grads_bytes"], estimate.grads),
             (measured["mem_optim_bytes"], estimate.optim),
             (sum(measured[f"mem_{k}_bytes"] for k in ("params", "grads", "optim", "master")), estimate.gpu)]
    for got, expected in pairs:
        assert got == pytest.approx(expected, rel=0.05)
    # the only difference is AdamW's per-parameter `step` counters (4-byte scalars)
    assert measured["mem_params_bytes"] == estimate.params


def test_shared_storage_counts_once_and_a_flat_buffer_counts_whole():
    flat = torch.zeros(100)  # a ZeRO-style flat buffer; parameters are views into it
    module = nn.Module()
    module.a = nn.Parameter(flat[:30])
    module.b = nn.Parameter(flat[30:60])
    module.tied = nn.Linear(4, 4, bias=False)
    module.head = nn.Linear(4, 4, bias=False)
    module.head.weight = module.tied.weight  # tied, as GPT-2's wte / lm_head
    bytes_ = count_model_state_bytes(module, None, master_params=[module.a])  # listed twice: counted once
    assert bytes_ == StateBytes(params=100 * 4 + 16 * 4, grads=0, optim=0, master=0)


def test_gradients_freed_after_the_optimizer_step_are_still_counted():
    # A plain torch loop frees gradients after each step (zero_grad(set_to_none=True)); the
    # monitor's optimizer pre-step hook sees them while they exist.
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    engine = SimpleNamespace(device=torch.device("cpu"), model=model, optimizer=optimizer)
    monitor = MemoryMonitor(engine)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert model_state_bytes(engine).grads == 0
    metrics = monitor.window_metrics(step=1)
    assert metrics["mem_params_bytes"] == metrics["mem_grads_bytes"] == (8 * 4 + 4) * 4
    assert metrics["mem_optim_bytes"] == 2 * (8 * 4 + 4) * 4 + 2 * 4  # two moments + two `step` scalars
    monitor.close()


def test_an_engine_can_report_its_own_model_state_bytes():
    # The protocol ZeRO uses: engine.model_state_bytes() -> this rank's StateBytes.
    shards = StateBytes(params=10, grads=20, optim=30, master=40)
    engine = SimpleNamespace(device=torch.device("cpu"), optimizer=None, model_state_bytes=lambda: shards)
    assert model_state_bytes(engine) == shards
    metrics = MemoryMonitor(engine).window_metrics(step=1)
    assert (metrics["mem_params_bytes"], metrics["mem_grads_bytes"], metrics["mem_optim_bytes"],
            metrics["mem_master_bytes"]) == (10, 20, 30, 40)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("memory")
    proc = run_cli("run", "quickstart", "--run-dir", str(run_dir), *TINY, "training.log_interval=2")
    assert proc.returncode == 0, proc.stderr
    return run_dir, proc.stdout, proc.stderr


def test_run_logs_memory_fields_every_window(tiny_run):
    run_dir, _, _ = tiny_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "loss" in m]
    assert [m["step"] for m in train] == [2, 4, 6]
    for m in train:
        assert MEMORY_FIELDS <= m.keys()
        assert all(isinstance(m[k], int) for k in MEMORY_FIELDS)
        assert m["mem_params_bytes"] == m["mem_grads_bytes"] > 0  # fp32 gradients mirror the parameters
        assert m["mem_optim_bytes"] >= 2 * m["mem_params_bytes"]  # Adam's two moments
        assert m["mem_peak_bytes"] >= m["rss_bytes"] > 10 * 2**20  # the CPU peak is the process's RSS peak
        assert "mfu" not in m  # a CPU has no peak FLOP/s: omitted, never a wrong number


def test_run_prints_a_memory_summary_and_writes_memory_png(tiny_run):
    run_dir, stdout, stderr = tiny_run
    assert "memory | model states per rank: params " in stdout
    assert "memory | peak " in stdout and "process peak RSS per window (VmHWM)" in stdout
    assert f"memory | timeline -> {run_dir / 'memory.png'}" in stdout
    assert (run_dir / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "peak FLOP/s" not in stderr  # a CPU has none: the start-up table says how to state one


def test_memory_png_is_skipped_with_a_note_without_matplotlib(monkeypatch, tmp_path):
    engine, monitor = train_steps(load_recipe("quickstart", TINY), 1)
    monitor.window_metrics(1)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import raises ImportError
    note = monitor.write_timeline(tmp_path / "memory.png")
    assert note == f'memory | no memory.png: matplotlib is not installed; pip install -e "{REPO}[dashboards]"'
    assert not (tmp_path / "memory.png").exists()


def test_summary_reports_the_largest_window():
    engine, monitor = train_steps(load_recipe("quickstart", TINY), 1)
    monitor.window_metrics(1)
    monitor.timeline.append({**monitor.timeline[0], "step": 2, "mem_peak_bytes": 5 * 2**30})
    assert "memory | peak 5.0 GiB at step 2" in monitor.summary()


def test_offloaded_bytes_reach_the_summary_and_memory_png(tmp_path, monkeypatch):
    from toolkit.observe.memory_monitor import plot_timeline
    from toolkit.ops import loader

    monkeypatch.setenv(loader.disable_env("cpu_adam"), "1")  # torch's CPU AdamW: the bytes are the same, no build
    for loaded in ("_modules", "_loaded", "_failures"):
        monkeypatch.setattr(loader, loaded, {})
    engine, monitor = train_steps(load_recipe("quickstart", [*TINY, "zero.stage=1", "zero.offload_optimizer=cpu"]), 1)
    metrics = monitor.window_metrics(1)
    n = engine.num_parameters
    assert metrics["mem_offload_bytes"] == 12 * n  # fp32 master + two moments, one rank
    assert f"memory | offloaded to CPU memory per rank: {format_bytes(12 * n)} " in monitor.summary()
    stacked = {}

    class Axes:  # what plot_timeline draws on: records the states panel's layers, ignores the rest
        def stackplot(self, steps, *ys, labels):
            stacked.update(zip(labels, ys))

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    class Recorder(Axes):  # the Figure API
        def __init__(self, **kwargs):
            pass

        def subplots(self, *args, **kwargs):
            return Axes(), Axes()

    plot_timeline(Recorder, monitor.timeline, "peak", tmp_path / "memory.png")
    assert stacked["offloaded optimizer (CPU memory)"] == [12 * n / 2**20]


@pytest.mark.cuda
def test_cuda_run_logs_allocator_peaks_and_mfu(tmp_path):
    from toolkit.observe.flops import device_key
    from toolkit.train.loop import run

    result = run(load_recipe("quickstart", [*TINY, "training.device=cuda", "training.log_interval=2"]), tmp_path,
                 quiet=True)
    known = device_key(torch.cuda.get_device_name()) is not None
    for m in result.train_metrics:
        states = sum(m[f"mem_{k}_bytes"] for k in ("params", "grads", "optim", "master"))
        assert m["mem_reserved_peak_bytes"] >= m["mem_peak_bytes"] >= states > 0  # allocator peaks hold the states
        assert m["rss_bytes"] > 0
        assert ("mfu" in m) is known
        if known:
            assert 0 < m["mfu"] < 1
