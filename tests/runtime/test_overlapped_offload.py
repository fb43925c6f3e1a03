"""zero.offload_update overlapped (toolkit/runtime/zero/overlapped_update.py): exact offload's step, each bucket's
pieces started as soon as the last micro-step's backward makes its gradient final.

The reference is exact mode itself: the same pieces through the same kernel, so every configuration must give
its losses and final weights bit for bit, in one process and on 2 gloo ranks, and resume bit-exactly.
"""
import threading

import pytest
import torch

from tests.runtime.zero_helpers import (BASE, SMALL_BUCKETS, assert_modes_bit_for_bit_on_two_ranks, save_and_resume,
                                        tiny_engine, train)
from toolkit.errors import UserError

NO_CLIP = "training.grad_clip=0"  # clipped runs speculate on the coefficient: test_overlapped_speculation.py
EXACT = ["zero.offload_optimizer=cpu", NO_CLIP]
OVERLAPPED = [*EXACT, "zero.offload_update=overlapped"]

CONFIGS = {
    "stage1 accum2": ["zero.stage=1", SMALL_BUCKETS, "batch.grad_accum_steps=2"],
    "stage2 accum2": ["zero.stage=2", SMALL_BUCKETS, "batch.grad_accum_steps=2"],
    "stage3": ["zero.stage=3"],
    "stage2 half on the device": ["zero.stage=2", SMALL_BUCKETS, "zero.offload_ratio=0.5"],
    "stage2 bf16 states": ["zero.stage=2", SMALL_BUCKETS, "precision.dtype=bf16", "optimizer.state_dtype=bf16"],
    "stage2 int8 moments": ["zero.stage=2", SMALL_BUCKETS, "optimizer.state_dtype=int8"],
    "stage3 params in CPU memory": ["zero.stage=3", "zero.offload_param=cpu"],
}


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1,000 elements, so a bucket is several pieces and both staging slots turn over."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)


def assert_same_run(a, b):
    engine_a, _, losses_a, _ = a
    engine_b, _, losses_b, _ = b
    assert losses_a == losses_b
    want = engine_a.strategy.full_parameters()
    got = engine_b.strategy.full_parameters()
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_one_process_is_exact_offload_bit_for_bit(overrides, small_pieces):
    exact = train(1, overrides + EXACT)
    overlapped = train(1, overrides + OVERLAPPED)
    part = overlapped[0].strategy.parts[-1]
    assert part.overlapped is not None and not part.overlapped.in_flight and len(part.offloaded_step.piece_spans) > 2
    assert_same_run(exact, overlapped)


@pytest.mark.parametrize("params", ["none", "nvme"])
def test_swap_files_are_exact_offload_bit_for_bit(params, tmp_path, small_pieces):
    """The optimizer in swap files; with offload_param nvme the thread writes new weights into the parameters' swap
    file while backward's gathers read the units it has not reached."""
    base = ["zero.stage=3", "zero.offload_optimizer=nvme", NO_CLIP, f"zero.nvme_path={tmp_path}",
            f"zero.offload_param={params}"]
    exact = train(1, base)
    overlapped = train(1, [*base, "zero.offload_update=overlapped"])
    assert overlapped[0].strategy.parts[-1].tier == "nvme" and overlapped[0].strategy.weights.tier == params
    assert_same_run(exact, overlapped)


def test_the_cpu_step_runs_while_backward_computes(small_pieces):
    """The thread steps a piece of the first final bucket while backward is still to finish the others: backward's
    hook for the second final bucket waits for that piece (an exact-mode step, run only after backward, would never
    set it: the wait would time out)."""
    _, engine, stream = tiny_engine(1, ["zero.stage=2", SMALL_BUCKETS, *OVERLAPPED])
    part = engine.strategy.parts[-1]
    assert len(part.groups) > 2
    stepped, waited, arrived = threading.Event(), [], []
    update, ready = part.offloaded_step._update, part.overlapped.ready

    def first_update(*args):
        update(*args)
        stepped.set()

    def ready_then_wait(local):
        # NOTE: from the second final bucket on, not on the thread having taken the first: under load the backward
        # can reach the second bucket before the thread wakes (a CI run did), which must not skip the check
        ready(local)
        arrived.append(local)
        if len(arrived) == 2:
            waited.append(stepped.wait(timeout=30))
    part.offloaded_step._update = first_update
    part.overlapped.ready = ready_then_wait
    engine.train_batch(stream.next_step())
    assert waited == [True]


def test_an_error_in_the_thread_is_raised_by_the_step(monkeypatch):
    _, engine, stream = tiny_engine(1, ["zero.stage=2", SMALL_BUCKETS, *OVERLAPPED])
    part = engine.strategy.parts[-1]

    def broken(*args, **kwargs):
        raise RuntimeError("the CPU step failed")
    monkeypatch.setattr(part.optimizer, "update", broken)
    with pytest.raises(RuntimeError, match="the CPU step failed"):
        engine.train_batch(stream.next_step())
    assert not part.overlapped.in_flight


def test_a_second_boundary_backward_before_the_step_is_refused():
    _, engine, stream = tiny_engine(1, ["zero.stage=2", *OVERLAPPED])
    batch = stream.next_step()[0]
    engine.backward(engine(batch))
    with pytest.raises(RuntimeError, match="call engine.step"):
        engine.backward(engine(batch))


def test_a_checkpoint_resumes_bit_exactly(tmp_path):
    overrides = ["zero.stage=2", SMALL_BUCKETS, *OVERLAPPED]
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path, overrides, overrides, save_after=5)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert resumed == uninterrupted


def test_the_start_up_lines_name_the_mode_and_add_no_buffer():
    _, exact, _ = tiny_engine(1, ["zero.stage=2", *EXACT])
    _, engine, _ = tiny_engine(1, ["zero.stage=2", *OVERLAPPED])
    assert "CPU step started during backward (zero.offload_update overlapped)" in engine.strategy.describe()
    assert engine.strategy.memory_bytes() == exact.strategy.memory_bytes()


@pytest.mark.parametrize("overrides, field", [
    (["zero.stage=2", *OVERLAPPED, "precision.dtype=fp16"], "recipe.precision.dtype: 'fp16' with zero.offload_update"),
    (["zero.stage=2", NO_CLIP, "zero.offload_update=overlapped"], "recipe.zero.offload_update: 'overlapped'"),
], ids=["fp16", "no offload"])
def test_what_the_overlapped_step_cannot_be_exact_with_is_one_line_naming_the_field(overrides, field):
    from toolkit.recipe.load import recipe_from_dict

    with pytest.raises(UserError, match=field):
        recipe_from_dict(BASE, overrides)


# ---------------------------------------------------------------------------
# 2 gloo ranks

DIST = {"stage2": ["zero.stage=2", SMALL_BUCKETS], "stage3": ["zero.stage=3"]}


@pytest.mark.dist
def test_two_gloo_ranks_are_exact_offload_bit_for_bit(tmp_path):
    assert_modes_bit_for_bit_on_two_ranks(tmp_path, DIST, {"exact": EXACT, "overlapped": OVERLAPPED})


def test_arrivals_hand_over_wanted_groups_in_arrival_or_shard_order():
    from toolkit.runtime.zero.overlapped_update import GroupArrivals

    for in_order, want in ((False, [2, 0, 1]), (True, [0, 1, 2])):
        arrivals = GroupArrivals([0, 1, 2], in_order)
        for local in (2, 3, 0):  # 3 holds no piece of this rank: ignored
            arrivals.put(local, None)
        assert arrivals.missing() == [1]
        got = [arrivals.take(block=False) for _ in range(2 if not in_order else 1)]
        assert arrivals.take(block=False) is None  # group 1 has not arrived
        arrivals.put(1, None)
        got += [arrivals.take(block=True) for _ in range(3 - len(got))]
        assert [g for g, _ in got] == want and arrivals.take(block=True) is None, in_order
