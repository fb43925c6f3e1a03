"""Loss scaler against a transcription of DeepSpeed's rule; overflow check; autocast policy."""
import contextlib
import random

import pytest
import torch

from tests.oracles import deepspeed
from toolkit.errors import UserError
from toolkit.runtime.precision import (DynamicLossScaler, autocast_context, has_inf_or_nan, make_loss_scaler)
from toolkit.specs import LossScaleSpec, PrecisionSpec


def spec(**overrides) -> LossScaleSpec:
    fields = dict(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                  consecutive_hysteresis=False, min_loss_scale=1, max_overflows_at_min_scale=50)
    return LossScaleSpec(**{**fields, **overrides})


def scripted_overflows(seed: int, steps: int = 400) -> list[bool]:
    """Bursts of overflows between clean stretches, some longer than the window."""
    rng = random.Random(seed)
    pattern = []
    while len(pattern) < steps:
        pattern += [False] * rng.choice([0, 1, 2, 3, 4, 5, 9])
        pattern += [True] * rng.choice([1, 1, 2, 3, 5])
    return pattern[:steps]


def run_both(pattern, **overrides):
    s = spec(**overrides)
    ours = DynamicLossScaler(s)
    ref = deepspeed.DynamicLossScaler(2.0 ** s.initial_scale_power, s.loss_scale_window, s.min_loss_scale,
                                      s.hysteresis, s.consecutive_hysteresis)
    ours_seq, ref_seq = [], []
    for overflow in pattern:
        assert ours.update(overflow) is overflow
        ref.update_scale(overflow)
        ours_seq.append((ours.scale, ours.cur_hysteresis))
        ref_seq.append((ref.cur_scale, ref.cur_hysteresis))
    return ours_seq, ref_seq


@pytest.mark.parametrize("hysteresis", [1, 2])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_sequence_matches_deepspeed_update_scale(hysteresis, consecutive, seed):
    pattern = scripted_overflows(seed)
    ours, ref = run_both(pattern, initial_scale_power=12, loss_scale_window=4, hysteresis=hysteresis,
                         consecutive_hysteresis=consecutive, min_loss_scale=0.25, max_overflows_at_min_scale=10**6)
    assert ours == ref
    assert len({scale for scale, _ in ours}) > 3  # the pattern really moves the scale both ways


def test_scale_sequence_hand_checked_hysteresis_2():
    # window 2: the third clean step doubles; the 2nd overflow halves; halving does not refill the credit.
    pattern = [False, False, False, True, True, True, False, False, False, True]
    ours, ref = run_both(pattern, initial_scale_power=4, loss_scale_window=2, hysteresis=2)
    assert [scale for scale, _ in ours] == [16, 16, 32, 32, 16, 8, 8, 8, 16, 16]
    assert ours == ref


def test_consecutive_hysteresis_refills_credit_after_each_clean_step():
    pattern = [True, False, True, False, True]  # never two overflows in a row
    on, _ = run_both(pattern, hysteresis=2, consecutive_hysteresis=True)
    off, _ = run_both(pattern, hysteresis=2, consecutive_hysteresis=False)
    assert [s for s, _ in on] == [2**16] * 5
    assert [s for s, _ in off] == [2**16, 2**16, 2**15, 2**15, 2**14]


def test_min_scale_clamps_halving():
    scaler = DynamicLossScaler(spec(initial_scale_power=3, hysteresis=1, min_loss_scale=3))
    seq = []
    for _ in range(4):
        scaler.update(True)
        seq.append(scaler.scale)
    assert seq == [4, 3, 3, 3]


def test_stops_after_max_overflows_at_min_scale():
    scaler = DynamicLossScaler(spec(initial_scale_power=1, hysteresis=1, max_overflows_at_min_scale=3))
    scaler.update(True)  # 2 -> 1, reaching the minimum is not yet an overflow *at* it
    scaler.update(True)
    scaler.update(True)
    scaler.update(False)  # a clean step resets the count
    scaler.update(True)
    scaler.update(True)
    with pytest.raises(UserError) as exc:
        scaler.update(True)
    assert len(exc.value.lines) == 1
    assert "min_loss_scale 1" in exc.value.lines[0] and "bf16" in exc.value.lines[0]


def test_static_scale_never_changes_but_skips_overflow_steps():
    scaler = DynamicLossScaler(spec(loss_scale=128))
    skips = [scaler.update(overflow) for overflow in [True] * 100 + [False] * 3000]
    assert scaler.scale == 128 and skips[:100] == [True] * 100 and not any(skips[100:])


def test_state_dict_round_trip_continues_identically():
    pattern = scripted_overflows(7, 200)
    a = DynamicLossScaler(spec(initial_scale_power=10, loss_scale_window=5))
    for overflow in pattern[:120]:
        a.update(overflow)
    state = a.state_dict()
    assert all(isinstance(v, (int, float)) for v in state.values())
    b = DynamicLossScaler(spec(initial_scale_power=10, loss_scale_window=5))
    b.load_state_dict(state)
    assert b.state_dict() == state
    for overflow in pattern[120:]:
        a.update(overflow)
        b.update(overflow)
        assert a.scale == b.scale
    with pytest.raises(UserError):
        b.load_state_dict({"cur_scale": 1.0})


def test_make_loss_scaler_only_for_fp16():
    assert make_loss_scaler(PrecisionSpec("fp32", spec())) is None
    assert make_loss_scaler(PrecisionSpec("bf16", spec())) is None
    assert make_loss_scaler(PrecisionSpec("fp16", spec(initial_scale_power=8))).scale == 256


def test_has_inf_or_nan_finds_bad_values_in_any_dtype():
    finite = [torch.full((1000,), 65504.0, dtype=torch.float16), torch.randn(3, 3), None,
              torch.randn(5, dtype=torch.bfloat16)]
    assert not has_inf_or_nan(finite)  # the 2-norm of the first tensor would overflow fp16
    assert not has_inf_or_nan([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            grad = torch.zeros(7, dtype=dtype)
            grad[3] = bad
            assert has_inf_or_nan([*finite, grad])


def test_autocast_context_by_dtype():
    assert isinstance(autocast_context("fp32", "cpu"), contextlib.nullcontext)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast_context(name, "cpu"):
            assert (a @ b).dtype == dtype
