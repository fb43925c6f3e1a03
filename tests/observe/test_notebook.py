"""toolkit/observe/notebook.py: the helpers the tutorial notebooks import measure and show what they say."""
from __future__ import annotations

import json
import time

import pytest
import torch

from toolkit.observe import notebook
from toolkit.observe.memory_monitor import rss_bytes

MiB = 2**20


def test_markdown_table_reads_back_through_markdown_tables():
    text = notebook.markdown_table(["dtype", "MiB"], [("fp32", "4.00"), ("bf16", 2)])
    assert text.splitlines()[1] == "|---|---|"
    assert notebook.markdown_tables("intro\n\n" + text + "\n\nafter") == [[{"dtype": "fp32", "MiB": "4.00"},
                                                                           {"dtype": "bf16", "MiB": "2"}]]


def test_markdown_tables_finds_each_table_once_and_stops_at_its_last_row():
    text = "| a | b |\n| --- | --- |\n| 1 | 2 |\nprose\n|x|\n|---|\n|y|\n|z|\n"
    assert notebook.markdown_tables(text) == [[{"a": "1", "b": "2"}], [{"x": "y"}, {"x": "z"}]]


def test_show_table_displays_the_markdown_text(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    notebook.show_table(["k", "v"], [("a", 1)])
    assert [s.data for s in shown] == ["| k | v |\n|---|---|\n| a | 1 |"]


class _Engine:
    """What saved_activation_bytes asks of an engine: .model and a forward call."""

    def __init__(self, n: int):
        self.model = torch.nn.Module()
        self.model.weight = torch.nn.Parameter(torch.ones(n))

    def __call__(self, x):
        return (x * self.model.weight).exp().sum()  # mul keeps x and the weight; exp keeps its output


def test_saved_activation_bytes_counts_what_backward_keeps_but_not_the_weights():
    n = 1000
    # x (4 kB) for mul's gradient to the weight, exp's output (4 kB); the weight itself is not an activation
    assert notebook.saved_activation_bytes(_Engine(n), torch.randn(n, requires_grad=True)) == 2 * 4 * n
    with torch.no_grad():  # nothing is kept for backward
        assert notebook.saved_activation_bytes(_Engine(n), torch.randn(n)) == 0


class _StepEngine:
    """What step_peak_bytes asks of an engine: .device and train_batch, here holding `mib` MiB for a moment."""

    device = torch.device("cpu")

    def __init__(self, mib: int):
        self.mib = mib

    def train_batch(self, micro_batches):
        held = torch.ones(self.mib * MiB // 4)
        return float(held.sum())


def test_step_peak_bytes_sees_a_step_that_holds_64_mib_and_not_one_that_holds_none():
    assert notebook.rss_follows_tensors()  # glibc on the CI machines
    big = notebook.step_peak_bytes(_StepEngine(64), [])
    small = notebook.step_peak_bytes(_StepEngine(0), [])
    assert 60 * MiB <= big <= 80 * MiB, big / MiB
    assert small < 8 * MiB, small / MiB


@pytest.mark.parametrize("stage", [0, 1])
def test_live_state_bytes_counts_a_one_process_stage0_engines_gradients_only_while_they_exist(stage):
    import toolkit
    from toolkit.observe.memory_monitor import model_state_bytes

    engine = toolkit.initialize(toolkit.load_recipe("quickstart", [f"zero.stage={stage}", "training.device=cpu"]))
    batch = [torch.randint(0, 256, (2, 65))]
    engine.train_batch(batch)
    states = model_state_bytes(engine)
    params = sum(p.nbytes for p in engine.model.parameters())
    if stage == 0:  # freed after the step: the memory line's params-sized gradients are not there now
        assert all(p.grad is None for p in engine.model.parameters())
        assert notebook.live_state_bytes(engine) == states.total - states.grads == states.total - params
        loss = engine(batch[0])
        engine.backward(loss)  # now they exist, and count
        assert notebook.live_state_bytes(engine) == states.total
    else:  # ZeRO keeps its gradient buffers between steps
        assert notebook.live_state_bytes(engine) == states.total


def test_after_rss_follows_tensors_a_freed_tensor_leaves_the_resident_set():
    notebook.rss_follows_tensors()
    before = rss_bytes()
    held = torch.ones(32 * MiB // 4)
    assert rss_bytes() - before >= 30 * MiB
    del held
    assert rss_bytes() - before < 4 * MiB


def test_synchronize_waits_for_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    notebook.synchronize("cpu")
    notebook.synchronize(torch.device("cpu"))
    assert calls == []
    notebook.synchronize("cuda")
    assert calls == [()]


def test_median_ms_warms_up_once_and_times_each_call():
    calls = []

    def sleep_2ms():
        calls.append(1)
        time.sleep(0.002)

    ms = notebook.median_ms(sleep_2ms, "cpu", calls=2, repeats=3)
    assert len(calls) == 1 + 2 * 3
    assert 1.9 <= ms < 20, ms


def test_fresh_process_peak_bytes_reads_the_largest_peak_its_run_logged(tmp_path):
    run_dir = tmp_path / "run"
    peak = notebook.fresh_process_peak_bytes("quickstart", ["training.device=cpu", "training.max_steps=2",
                                                            "training.log_interval=1", "training.eval_interval=0",
                                                            "checkpoint.save_final=false"], run_dir)
    logged = [json.loads(line).get("mem_peak_bytes", 0) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert peak == max(logged) > 0


def test_fresh_process_peak_bytes_names_a_failed_run(tmp_path):
    with pytest.raises(RuntimeError, match="exit code"):
        notebook.fresh_process_peak_bytes("quickstart", ["zero.stage=9"], tmp_path / "run")


def test_launch_ranks_runs_the_script_once_per_rank_with_its_folder(tmp_path):
    script = ("import os, sys, toolkit\nfrom pathlib import Path\n"
              "Path(sys.argv[1], 'rank' + os.environ['RANK']).write_text(toolkit.__file__)\n")
    done = notebook.launch_ranks(script, tmp_path, 2)
    assert done.returncode == 0, done.stderr[-2000:]
    import toolkit
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [toolkit.__file__] * 2
