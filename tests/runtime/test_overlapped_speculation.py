"""zero.offload_update overlapped with global-norm clipping (toolkit/runtime/zero/speculation.py): the pieces step
before the clip coefficient exists, as if it were 1, and are restored and stepped again when it is not.

The reference is exact mode with the same clipping: losses and final weights bit for bit, whether a step's
speculation stood (no clipping), was rolled back (clipped), or was skipped (the step after a clipped one), and with
the arena too small for the whole shard (the rest of the pieces wait for the coefficient).
"""
import pytest
import torch

from tests.runtime.zero_helpers import (BASE, SMALL_BUCKETS, STEPS, assert_modes_bit_for_bit_on_two_ranks,
                                        save_and_resume, tiny_engine, train)
from toolkit.errors import UserError

# The tiny run's gradient norms are 0.84-1.0 over its 10 steps: at 0.9 some steps clip and some do not.
MIXED = "training.grad_clip=0.9"
EXACT = ["zero.offload_optimizer=cpu", MIXED]
OVERLAPPED = [*EXACT, "zero.offload_update=overlapped"]

CONFIGS = {
    "stage1 accum2": ["zero.stage=1", SMALL_BUCKETS, "batch.grad_accum_steps=2"],
    "stage2": ["zero.stage=2", SMALL_BUCKETS],
    "stage3": ["zero.stage=3"],
    "stage2 half on the device": ["zero.stage=2", SMALL_BUCKETS, "zero.offload_ratio=0.5"],
    "stage2 bf16 states": ["zero.stage=2", SMALL_BUCKETS, "precision.dtype=bf16", "optimizer.state_dtype=bf16"],
    "stage3 bf16 gradient shard": ["zero.stage=3", "precision.dtype=bf16", "optimizer.state_dtype=bf16",
                                   "zero.grad_dtype=bf16"],
    "stage3 params in CPU memory": ["zero.stage=3", "zero.offload_param=cpu"],
}


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1,000 elements, so a bucket is several pieces and the arena holds many."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)


@pytest.fixture
def thread_first(monkeypatch):
    """The coefficient is delivered only once the thread has speculated a piece (when it may): on a loaded machine
    the optimizer step could otherwise reach the verdict before the thread reaches any piece."""
    import time

    from toolkit.runtime.zero.speculation import ClipSpeculation

    deliver = ClipSpeculation.deliver

    def deliver_after_a_piece(self, coef, scale):
        deadline = time.monotonic() + 10
        while self.enabled and not self.used and time.monotonic() < deadline:
            time.sleep(0.001)
        deliver(self, coef, scale)

    monkeypatch.setattr(ClipSpeculation, "deliver", deliver_after_a_piece)


def verdicts(engine) -> list[str]:
    """What each step's speculation came to: 'stood', 'rolled back' or 'waited' (no piece speculated)."""
    return list(engine.strategy.parts[-1].overlapped.speculation.outcomes)


def assert_same_run(a, b):
    engine_a, _, losses_a, norms_a = a
    engine_b, _, losses_b, norms_b = b
    assert losses_a == losses_b and norms_a == norms_b
    want = engine_a.strategy.full_parameters()
    got = engine_b.strategy.full_parameters()
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_clipped_runs_are_exact_offload_bit_for_bit(overrides, small_pieces, thread_first):
    exact = train(1, overrides + EXACT)
    overlapped = train(1, overrides + OVERLAPPED)
    assert_same_run(exact, overlapped)
    # the run went through every path: a speculation that stood, one rolled back, a step that waited
    assert {"stood", "rolled back", "waited"} <= set(verdicts(overlapped[0])), verdicts(overlapped[0])
    clipped = [norm > 0.9 for norm in exact[3]]
    assert any(clipped) and not all(clipped)


def test_a_step_after_a_clipped_one_does_not_speculate(small_pieces, thread_first, monkeypatch):
    """...and fetches no gradient before the verdict: an unclipped copy would only be fetched again."""
    from toolkit.runtime.zero.speculation import ClipSpeculation

    fetched = []  # (the step guesses, the copy read the unclipped gradient)
    fetch = ClipSpeculation.fetch
    monkeypatch.setattr(ClipSpeculation, "fetch", lambda self, copy: fetched.append((self.enabled, fetch(self, copy)))
                        or fetched[-1][1])
    exact = train(1, ["zero.stage=2", SMALL_BUCKETS, *EXACT])
    seen = verdicts(train(1, ["zero.stage=2", SMALL_BUCKETS, *OVERLAPPED])[0])
    assert (False, True) not in fetched and (True, True) in fetched and (False, False) in fetched
    assert len(seen) == STEPS
    clipped = [norm > 0.9 for norm in exact[3]]
    assert seen[0] == ("rolled back" if clipped[0] else "stood")
    for t in range(1, STEPS):
        if clipped[t - 1]:
            assert seen[t] == "waited", (t, seen)
        else:
            assert seen[t] == ("rolled back" if clipped[t] else "stood"), (t, seen)


def test_an_arena_smaller_than_the_shard_is_still_exact(small_pieces, monkeypatch):
    """At most SPECULATED_SHARE of the elements speculate; the later pieces wait for the coefficient."""
    monkeypatch.setattr("toolkit.runtime.zero.speculation.SPECULATED_SHARE", 0.1)
    exact = train(1, ["zero.stage=2", SMALL_BUCKETS, *EXACT])
    overlapped = train(1, ["zero.stage=2", SMALL_BUCKETS, *OVERLAPPED])
    assert_same_run(exact, overlapped)
    speculation = overlapped[0].strategy.parts[-1].overlapped.speculation
    numel = speculation.states[0].numel()
    assert 0 < speculation.limit <= 0.1 * numel + 1
    assert all(t.numel() == speculation.limit for t in speculation.host_tensors())


def test_a_checkpoint_resumes_bit_exactly(tmp_path, small_pieces):
    """The resumed engine does not know whether the step before the save clipped, so its first step may speculate
    where the uninterrupted run waited: the guess changes when pieces run, never what they compute."""
    overrides = ["zero.stage=2", SMALL_BUCKETS, *OVERLAPPED]
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path, overrides, overrides, save_after=5)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert resumed == uninterrupted


def test_without_clipping_nothing_is_saved(small_pieces):
    engine = train(1, ["zero.stage=2", SMALL_BUCKETS, "zero.offload_optimizer=cpu", "training.grad_clip=0",
                       "zero.offload_update=overlapped"])[0]
    assert engine.strategy.parts[-1].overlapped.speculation is None


@pytest.mark.parametrize("overrides, what", [
    (["zero.stage=2", "zero.offload_optimizer=nvme", "zero.nvme_path=/tmp"], "swap files"),
    (["zero.stage=2", "zero.offload_optimizer=cpu", "optimizer.state_dtype=int8"], "int8 moments"),
], ids=["swap files", "int8 moments"])
def test_clipping_with_states_it_cannot_save_is_one_line_naming_the_field(overrides, what):
    from toolkit.recipe.load import recipe_from_dict

    with pytest.raises(UserError, match=f"recipe.training.grad_clip: 0.9 with zero.offload_update 'overlapped'.*{what}"):
        recipe_from_dict(BASE, [*overrides, MIXED, "zero.offload_update=overlapped"])


def test_the_start_up_lines_and_the_estimate_count_the_arena():
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.tiers import input_tiers

    recipe, engine, _ = tiny_engine(1, ["zero.stage=2", *OVERLAPPED])
    exact_recipe, exact, _ = tiny_engine(1, ["zero.stage=2", *EXACT])
    speculation = engine.strategy.parts[-1].overlapped.speculation
    arena = sum(t.untyped_storage().nbytes() for t in speculation.host_tensors())
    numel = engine.strategy.layout.numel
    assert arena == 12 * -(-numel // 2)  # an fp32 master and two fp32 moments for half the elements
    assert "overlapped-update rollback copies CPU memory" in engine.strategy.describe_tiers()
    held = engine.strategy.memory_bytes()["mem_offload_bytes"] - exact.strategy.memory_bytes()["mem_offload_bytes"]
    assert held == arena
    extra = input_tiers(EstimateInput.from_recipe(recipe)).cpu - input_tiers(EstimateInput.from_recipe(exact_recipe)).cpu
    assert extra == arena


# ---------------------------------------------------------------------------
# 2 gloo ranks: the coefficient is the global norm's, the same on every rank

@pytest.mark.dist
def test_two_gloo_ranks_are_exact_offload_bit_for_bit(tmp_path):
    assert_modes_bit_for_bit_on_two_ranks(tmp_path, {"stage2": ["zero.stage=2", SMALL_BUCKETS]},
                                          {"exact": EXACT, "overlapped": OVERLAPPED})
