"""The bf16 CPU warning: said only where torch has no oneDNN bf16 matmul, with the ratio it measured, once."""
import pytest
import torch

import toolkit
from toolkit.runtime import cpu_matmul
from toolkit.runtime.cpu_matmul import WARN_RATIO, has_onednn_bf16, slow_bf16_warning

CPU = torch.device("cpu")


def measured(monkeypatch, bf16_ms: float, fp32_ms: float = 1.0) -> list[torch.dtype]:
    """matmul_ms answers these times and records which dtypes were timed."""
    timed = []

    def fake(dtype, side=cpu_matmul.SIDE, repeats=3):
        timed.append(dtype)
        return bf16_ms if dtype == torch.bfloat16 else fp32_ms
    monkeypatch.setattr(cpu_matmul, "matmul_ms", fake)
    return timed


def test_this_torch_answers_whether_onednn_serves_bf16():
    assert has_onednn_bf16() in (True, False)  # the private op exists in the torch we run on


@pytest.mark.parametrize("dtype, device", [("fp32", CPU), ("bf16", torch.device("cuda", 0))])
def test_nothing_is_measured_off_a_bf16_cpu_run(monkeypatch, dtype, device):
    timed = measured(monkeypatch, bf16_ms=30.0)
    monkeypatch.setattr(cpu_matmul, "has_onednn_bf16", lambda: False)
    assert slow_bf16_warning(dtype, device) is None and timed == []


@pytest.mark.parametrize("answer", [True, None])
def test_a_cpu_with_onednn_bf16_or_no_answer_gets_no_warning_and_no_measurement(monkeypatch, answer):
    timed = measured(monkeypatch, bf16_ms=30.0)
    monkeypatch.setattr(cpu_matmul, "has_onednn_bf16", lambda: answer)
    assert slow_bf16_warning("bf16", CPU) is None and timed == []


def test_a_slow_cpu_is_warned_with_the_ratio_it_measured_and_the_key_to_change(monkeypatch):
    timed = measured(monkeypatch, bf16_ms=31.0)
    monkeypatch.setattr(cpu_matmul, "has_onednn_bf16", lambda: False)
    warning = slow_bf16_warning("bf16", CPU)
    assert timed == [torch.bfloat16, torch.float32]
    assert warning.startswith("warning: recipe.precision.dtype: 'bf16' on this CPU (")
    assert "31x the time of fp32 ones" in warning and "precision.dtype=fp32" in warning and "\n" not in warning


def test_a_ratio_under_the_threshold_is_not_worth_a_warning(monkeypatch):
    measured(monkeypatch, bf16_ms=WARN_RATIO * 0.9)
    monkeypatch.setattr(cpu_matmul, "has_onednn_bf16", lambda: False)
    assert slow_bf16_warning("bf16", CPU) is None


def test_the_engine_prints_the_warning_once_per_process_before_training(monkeypatch, capsys):
    timed = measured(monkeypatch, bf16_ms=40.0)
    monkeypatch.setattr(cpu_matmul, "has_onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_matmul, "_said", False)
    bf16 = toolkit.load_recipe("quickstart", ["training.device=cpu", "precision.dtype=bf16"])
    toolkit.initialize(bf16)
    err = capsys.readouterr().err
    assert err.count("warning: recipe.precision.dtype: 'bf16'") == 1 and "40x" in err
    toolkit.initialize(bf16)  # a second engine in the process (a notebook's): neither measured nor said again
    assert "precision.dtype" not in capsys.readouterr().err and len(timed) == 2
    toolkit.initialize(toolkit.load_recipe("quickstart", ["training.device=cpu"]))  # fp32: nothing
    assert "precision.dtype" not in capsys.readouterr().err
