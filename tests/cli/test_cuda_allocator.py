"""The CUDA allocator's settings (toolkit/cuda_allocator.py): the command line turns on expandable segments unless
the user chose, the memory model predicts reserved bytes for the setting in effect, and the committed measurements
hold the reason for the default."""
import json
import os
import statistics
from pathlib import Path

import pytest

from toolkit.cli.main import main
from toolkit.cuda_allocator import alloc_conf, expandable_segments, use_expandable_segments_by_default
from toolkit.observe.peak import EXPANDABLE_RESERVED_FACTOR, RESERVED_FACTOR, predict_peak
from toolkit.recipe.load import load_recipe

CALIBRATION = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_calibration"
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def test_the_default_is_set_only_where_the_user_set_neither_variable():
    env = {}
    use_expandable_segments_by_default(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in VARIABLES:
        env = {name: "max_split_size_mb:128"}
        use_expandable_segments_by_default(env)
        assert env == {name: "max_split_size_mb:128"}, name
    assert alloc_conf({"PYTORCH_ALLOC_CONF": "a:1"}) == "a:1" and alloc_conf({}) == ""


@pytest.mark.parametrize("conf, on", [
    ("", False), ("expandable_segments:True", True), ("max_split_size_mb:128, expandable_segments:True", True),
    ("expandable_segments:False", False), ("expandable_segments:True,expandable_segments:False", False),
    ("garbage_collection_threshold:0.6", False)])
def test_which_settings_turn_on_expandable_segments(conf, on):
    assert expandable_segments(conf) is on


@pytest.fixture
def unset(monkeypatch):
    """Neither variable set; both restored afterwards (set first, so the monkeypatch records them)."""
    for name in VARIABLES:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)


def test_the_command_line_turns_it_on(unset):
    assert main(["validate", "recipes/quickstart.json"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_the_command_line_keeps_the_users_setting(unset, monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert main(["estimate", "gpt2-124m", "--device", "h100"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert "reserved by the allocator (torch's default segments): about" in capsys.readouterr().out


def test_the_reserved_prediction_follows_the_setting():
    recipe = load_recipe("gpt2-124m", [])
    default = predict_peak(recipe, on_cuda=True, expandable_segments=False)
    expandable = predict_peak(recipe, on_cuda=True, expandable_segments=True)
    assert default.allocated == expandable.allocated  # the allocator changes what is reserved, not allocated
    assert expandable.reserved == int(EXPANDABLE_RESERVED_FACTOR * expandable.allocated)
    assert default.reserved == int(RESERVED_FACTOR * default.allocated)


def _measured_ratios(name: str) -> list[float]:
    rows = [json.loads(line) for line in (CALIBRATION / name).read_text().splitlines() if line.strip()]
    return [r["mem_reserved_peak_bytes"] / r["mem_peak_bytes"] for r in rows if r["status"] == "ok"]


def test_the_measurements_behind_the_default():
    """cuda_allocator's docstring: reserved / allocated 1.006-1.81 (median 1.10) with torch's default segments,
    1.002-1.06 (median 1.014) with expandable segments over the GPU matrix, 1.003-1.15 held out."""
    default = _measured_ratios("h200.jsonl") + _measured_ratios("h200-holdout.jsonl")
    expandable = _measured_ratios("h100-expandable.jsonl")
    held_out = _measured_ratios("h100-expandable-holdout.jsonl")
    assert len(expandable) >= 30 and len(held_out) >= 15
    assert len(default) == 49 and 1.09 <= statistics.median(default) <= 1.11 and 1.8 <= max(default) <= 1.82
    assert statistics.median(expandable) == pytest.approx(EXPANDABLE_RESERVED_FACTOR, abs=0.002)
    assert 1.0 <= min(expandable) and max(expandable) <= 1.06
    assert 1.0 <= min(held_out) and max(held_out) <= 1.15


def test_the_start_up_tables_words_name_the_setting_and_where_it_came_from(unset, monkeypatch):
    from toolkit.cuda_allocator import describe

    assert describe() == "CUDA allocator: torch's default segments (no PYTORCH_CUDA_ALLOC_CONF)"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    assert describe() == "CUDA allocator: expandable segments (expandable_segments:True,max_split_size_mb:64)"


def test_calibration_rows_record_the_setting_their_runs_used(unset, monkeypatch, tmp_path):
    """benchmarks/memory_calibration.py's `toolkit run`s take the CLI's default where the variables are unset: its
    rows must say so (the run itself is stood in for)."""
    from benchmarks import memory_calibration

    monkeypatch.setattr(memory_calibration, "run_config", lambda cfg, steps: {"status": "ok", "mem_peak_bytes": 1})
    out = tmp_path / "rows.jsonl"
    assert memory_calibration.main(["--matrix", "cpu", "--only", "quickstart m16x2 stage=0", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["alloc_conf"] == "expandable_segments:True"
    assert expandable_segments(rows[0]["alloc_conf"])


def test_doctor_names_the_setting_on_a_machine_with_a_gpu(monkeypatch):
    import torch

    from toolkit.cli.main import _doctor_environment

    for name, value in {"is_available": lambda: True, "device_count": lambda: 1,
                        "get_device_capability": lambda i: (9, 0), "get_device_name": lambda i: "NVIDIA H200"}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    lines = _doctor_environment()
    assert "cuda:0 NVIDIA H200 (compute capability 9.0)" in lines
    assert any(line.startswith("CUDA allocator: expandable segments (expandable_segments:True) (the toolkit "
                               "command's default") for line in lines), lines
