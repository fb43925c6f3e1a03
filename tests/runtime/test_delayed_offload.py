"""zero.offload_update delayed (toolkit/runtime/zero/delayed_update.py): ZeRO-Offload's one-step delayed update.

The reference is the delayed rule written out by hand around a stage-0 engine (torch's AdamW on whole tensors,
no offload): the forward uses weights W, the optimizer steps a separate master M, and after the warm-up

    g_t = grad(W);  W = M_{t-1};  M_t = AdamW(M_{t-1}, g_t)

(in the warm-up, W = M_t after each step). Every offloaded configuration, in one process and on 2 gloo ranks,
ends within the ZeRO tests' tolerance of it (tests/runtime/zero_helpers.py: rtol and atol 1e-5, and why).
"""
import pytest
import torch

from tests.conftest import become_rank, leave_rank
from tests.runtime.zero_helpers import (BASE, DELAYED, RTOL, SMALL_BUCKETS, STEPS, WARMUP, assert_params_close,
                                        assert_the_repeated_clip_equals_copying_again, delayed_reference, fork_ranks,
                                        owned_states, save_and_resume, tiny_engine, train)

@pytest.fixture(scope="module")
def reference():
    return delayed_reference(WARMUP)


def finished(engine) -> dict:
    """The full parameters once the update in flight has landed (as the training loop ends)."""
    engine.strategy.complete_pending_update()
    return engine.strategy.full_parameters()


@pytest.mark.parametrize("overrides", [["zero.stage=1"], ["zero.stage=2", SMALL_BUCKETS, "batch.grad_accum_steps=2"],
                                       ["zero.stage=3"]], ids=" ".join)
def test_one_process_follows_the_hand_written_delayed_rule(overrides, reference):
    engine, _, losses, _ = train(1, overrides + DELAYED)
    part = engine.strategy.parts[-1]
    assert part.delayed is not None and part.delayed.in_flight  # the last step's update is still running
    ref_losses, ref_master = reference
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert_params_close(finished(engine), ref_master)


@pytest.mark.parametrize("overrides", [["zero.stage=2", SMALL_BUCKETS], ["zero.stage=3"]], ids=" ".join)
@pytest.mark.parametrize("clip", [0.0, 0.9], ids=["unclipped", "some steps clipped"])
def test_backward_copies_each_gradient_early_and_a_clip_is_repeated_on_the_copy(overrides, clip, monkeypatch):
    """Each group's gradient is copied to the host when backward makes it final; a clip after that multiplies the
    device's gradients, and the thread multiplies the copy by the same coefficient (at 0.9 some steps clip)."""
    from toolkit.runtime.zero.delayed_update import DelayedUpdate

    seen = []  # at each launch's stage: (groups copied during backward, the multiplies since)
    stage = DelayedUpdate.stage
    monkeypatch.setattr(DelayedUpdate, "stage", lambda self: seen.append((self.early, self.scales)) or stage(self))
    base = [f"training.grad_clip={clip}"]
    engine, _, losses, norms = train(1, [*overrides, *base, *DELAYED])
    ref_losses, ref_master = delayed_reference(WARMUP, base=base)
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert_params_close(finished(engine), ref_master)
    groups = len(engine.strategy.parts[-1].delayed.grad_chunks)
    assert len(seen) == STEPS - WARMUP and all(early == groups for early, _ in seen), seen
    clipped = [clip > 0 and norm + 1e-6 > clip for norm in norms[WARMUP:]]
    assert [len(scales) for _, scales in seen] == [int(c) for c in clipped]
    assert all(scales == [pytest.approx(clip / (norm + 1e-6))] for (_, scales), norm, c
               in zip(seen, norms[WARMUP:], clipped) if c)
    assert not any(clipped) if clip == 0 else 0 < sum(clipped) < len(clipped)


def test_the_clip_repeated_on_the_copy_equals_copying_the_clipped_gradients_bit_for_bit(monkeypatch):
    """The thread's multiply of the early copy gives the floats the device's multiply gave: the same run with
    every clipped step's gradients copied again (as for a 16-bit gradient shard) has the same losses and weights."""
    # the recipe's clip 0.5 clips every step of this run
    assert_the_repeated_clip_equals_copying_again(["zero.stage=2", SMALL_BUCKETS, "training.grad_clip=0.5", *DELAYED],
                                                  monkeypatch)


def test_an_unscale_after_backward_is_repeated_on_the_copy_without_copying_again(monkeypatch):
    """fp16's unscale multiplies the gradients after the backward's early copies (fp16 runs on a GPU only, so the
    strategy's call is made here by hand): by 1 nothing is repeated, by anything else the thread repeats it."""
    engine, stream, _, _ = train(1, ["zero.stage=2", SMALL_BUCKETS, "training.grad_clip=0", *DELAYED], steps=WARMUP)
    delayed = engine.strategy.parts[-1].delayed
    for batch in stream.next_step():
        engine.backward(engine(batch))
    assert delayed.early == len(delayed.grad_chunks) and delayed.scales == []
    engine.strategy.scale_grads(1.0)
    assert delayed.scales == []
    engine.strategy.scale_grads(0.5)
    engine.strategy.scale_grads(0.25)
    assert delayed.scales == [0.5, 0.25]
    copies = []
    monkeypatch.setattr(delayed, "_copy", lambda groups: copies.append(list(groups)))
    engine.step()
    assert delayed.in_flight and delayed.early is None and copies == []
    assert delayed.cpu_step.grad_scales == (0.5, 0.25)


def test_with_part_of_the_optimizer_on_the_device_only_the_offloaded_parameters_step_late():
    engine, _, losses, _ = train(1, ["zero.stage=2", SMALL_BUCKETS, "zero.offload_ratio=0.5", *DELAYED])
    kept, offloaded = engine.strategy.parts
    assert kept.delayed is None and offloaded.delayed is not None
    late = {slot.name for g in offloaded.groups for slot in engine.strategy.groups[g].slots}
    assert late and late != set(engine.strategy.full_parameters())
    ref_losses, ref_master = delayed_reference(WARMUP, delayed_names=late)
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert_params_close(finished(engine), ref_master)


@pytest.mark.parametrize("overrides", [["zero.stage=2", SMALL_BUCKETS], ["zero.stage=3"]], ids=" ".join)
def test_delayed_extrapolated_follows_its_hand_written_rule_and_lands_the_master(overrides):
    extrapolated = [*DELAYED[:2], f"zero.offload_update_warmup={WARMUP}", "zero.offload_update=delayed_extrapolated"]
    engine, _, losses, _ = train(1, overrides + extrapolated)
    ref_losses, ref_master = delayed_reference(WARMUP, extrapolate=True)
    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert losses != pytest.approx(delayed_reference(WARMUP)[0], rel=100 * RTOL)  # not plain delayed
    assert_params_close(finished(engine), ref_master)  # what lands at the end is the master, not an extrapolation


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu_adam kernel", "torch ops"])
def test_extrapolated_weights_are_the_new_ones_plus_the_update_on_either_path(kernel):
    from toolkit.recipe.load import recipe_from_dict
    from toolkit.runtime.zero.adamw import ShardedAdamW

    optimizer = ShardedAdamW(recipe_from_dict(BASE, []).optimizer, 5000, torch.device("cpu"), offload=True)
    if kernel and optimizer.kernel is None:
        pytest.skip("the CPU Adam kernel is not built here")
    if not kernel:
        optimizer.kernel, optimizer.mode = None, "fused"
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(5000, generator=gen), torch.randn(5000, generator=gen)
    m, v, out, old = torch.zeros(5000), torch.zeros(5000), torch.empty(5000, dtype=torch.bfloat16), p.clone()
    optimizer.begin_step()
    optimizer.update(True, p, g, m, v, out, extrapolate=True)
    assert not torch.equal(p, old)  # the master took the plain update
    assert torch.equal(out, torch.add(p, p - old).to(torch.bfloat16))


def test_the_rule_is_not_the_exact_one():
    """The reference would pass for exact offload too if the delay changed nothing: it changes the losses by far
    more than the tolerance from the first delayed step's successor on."""
    exact, _ = delayed_reference(warmup=STEPS)
    delayed, _ = delayed_reference(WARMUP)
    assert exact[:WARMUP + 1] == delayed[:WARMUP + 1]
    assert all(abs(a - b) > 100 * RTOL * abs(a) for a, b in zip(exact[WARMUP + 1:], delayed[WARMUP + 1:]))


def test_a_warm_up_as_long_as_the_run_is_exact_offload_bit_for_bit():
    exact, _, exact_losses, _ = train(1, ["zero.stage=2", "zero.offload_optimizer=cpu"])
    delayed, _, delayed_losses, _ = train(1, ["zero.stage=2", *DELAYED[:2], f"zero.offload_update_warmup={STEPS}"])
    assert delayed_losses == exact_losses
    assert all(torch.equal(a, b) for a, b in zip(finished(delayed).values(), exact.strategy.full_parameters().values()))


def test_swap_files_follow_the_rule_too(tmp_path, reference):
    engine, _, losses, _ = train(1, ["zero.stage=3", f"zero.nvme_path={tmp_path}", *DELAYED[1:],
                                     "zero.offload_optimizer=nvme"])
    assert engine.strategy.parts[-1].tier == "nvme"
    assert losses == pytest.approx(reference[0], rel=RTOL)
    assert_params_close(finished(engine), reference[1])


@pytest.mark.parametrize("mode", ["delayed", "delayed_extrapolated"])
def test_a_checkpoint_lands_the_update_and_resumes_bit_exactly(tmp_path, mode):
    overrides = ["zero.stage=2", SMALL_BUCKETS, *DELAYED, f"zero.offload_update={mode}"]
    saved, restored, uninterrupted, resumed, engine = save_and_resume(tmp_path, overrides, overrides, save_after=5)
    assert all(torch.equal(saved[k], restored[k]) for k in saved)
    assert resumed == uninterrupted  # bitwise: the save landed the update, the resume starts from that point


def test_evaluation_sees_the_last_update():
    _, engine, stream = tiny_engine(1, ["zero.stage=1", *DELAYED])
    for _ in range(WARMUP + 2):
        engine.train_batch(stream.next_step())
    part = engine.strategy.parts[-1]
    assert part.delayed.in_flight
    batches = stream.next_step()
    evaluated = engine.evaluate(batches)
    assert not part.delayed.in_flight
    assert engine.evaluate(batches) == evaluated  # nothing else lands: the weights are the last update's


class _Skipping:
    """An fp16 loss scaler stand-in whose every step overflows (a CPU has no fp16 training)."""
    scale = 1.0

    def update(self, overflow) -> bool:
        return True


@pytest.mark.parametrize("overrides", [["zero.stage=1"], ["zero.stage=2", SMALL_BUCKETS]], ids=" ".join)
def test_a_skipped_step_lands_the_update_in_flight_whole(overrides, monkeypatch):
    # its backward may have landed some groups early: the rest must land before the next forward reads them
    _, engine, stream = tiny_engine(1, [*overrides, *DELAYED])
    for _ in range(WARMUP + 2):
        engine.train_batch(stream.next_step())
    part = engine.strategy.parts[-1]
    assert part.delayed.in_flight
    monkeypatch.setattr(engine, "loss_scaler", _Skipping())
    result = engine.train_batch(stream.next_step())
    assert result.skipped and not part.delayed.in_flight and part.delayed.landing is None
    master = engine.strategy.parts[-1].master
    weights = torch.cat([part.weights.read(g) for g in part.groups])
    torch.testing.assert_close(weights, master.to(weights.dtype), rtol=0, atol=0)


def test_an_error_in_the_background_step_is_raised_where_the_update_lands(monkeypatch):
    _, engine, stream = tiny_engine(1, ["zero.stage=1", *DELAYED[:2], "zero.offload_update_warmup=0"])
    part = engine.strategy.parts[-1]

    def broken(*args, **kwargs):
        raise RuntimeError("the CPU step failed")
    monkeypatch.setattr(part.optimizer, "update", broken)
    engine.train_batch(stream.next_step())  # launched: the thread fails, the main thread goes on
    with pytest.raises(RuntimeError, match="the CPU step failed"):
        engine.train_batch(stream.next_step())


def test_a_step_copies_its_gradients_before_landing_the_update_in_flight_into_the_other_buffer(monkeypatch):
    """Two host buffers of each, taken in turn: the copy of step t's gradients does not wait for step t-1's thread,
    which reads (and writes its weights to) the other buffer; the run still follows the hand-written rule (above)."""
    from toolkit.runtime.zero.delayed_update import DelayedUpdate

    seen = []  # at each stage: (an update in flight, the buffer its step reads is the one the copy goes to, that one)
    stage = DelayedUpdate.stage
    monkeypatch.setattr(DelayedUpdate, "stage", lambda self: seen.append(
        (self.in_flight, self.cpu_step.grad_chunks is self.grad_views[self.turn], self.turn)) or stage(self))
    train(1, ["zero.stage=1", *DELAYED], steps=WARMUP + 4)
    assert len(seen) == 4 and not seen[0][0] and all(flight for flight, _, _ in seen[1:])
    assert not any(same for _, same, _ in seen[1:])
    assert [turn for _, _, turn in seen] == [0, 1, 0, 1]


def test_owned_pieces_refuse_an_update_in_flight():
    engine, _, _, _ = train(1, ["zero.stage=1", *DELAYED], steps=WARMUP + 1)
    with pytest.raises(RuntimeError, match="complete_pending_update"):
        engine.strategy.owned_pieces()
    engine.strategy.complete_pending_update()
    assert owned_states(engine)


def test_the_start_up_lines_name_the_mode_and_its_buffers():
    _, engine, _ = tiny_engine(1, ["zero.stage=1", *DELAYED])
    numel = engine.strategy.layout.numel
    assert f"update delayed one step after {WARMUP} exact steps" in engine.strategy.describe()
    assert "delayed-update gradient + weight copies CPU memory" in engine.strategy.describe_tiers()
    # master + moments (12 bytes) and the delayed buffers: two fp32 gradients and two fp32 weight copies
    assert engine.strategy.memory_bytes()["mem_offload_bytes"] == (12 + 2 * (4 + 4)) * numel


def test_delayed_without_offload_is_one_line_naming_the_field():
    from toolkit.errors import UserError
    from toolkit.recipe.load import recipe_from_dict
    from tests.runtime.zero_helpers import BASE

    with pytest.raises(UserError, match=r"recipe.zero.offload_update: 'delayed' .* needs zero.offload_optimizer"):
        recipe_from_dict(BASE, ["zero.stage=2", "zero.offload_update=delayed"])


# ---------------------------------------------------------------------------
# 2 gloo ranks

DIST = {"stage2": ["zero.stage=2", SMALL_BUCKETS], "stage3": ["zero.stage=3"]}


def _rank_main(rank, world, port, out_dir):
    become_rank(rank, world, port)
    results = {}
    for name, overrides in DIST.items():
        engine, _, losses, _ = train(world, overrides + DELAYED)
        results[name] = {"losses": losses, "params": finished(engine)}
    torch.save(results, out_dir / f"rank{rank}.pt")
    leave_rank()


@pytest.mark.dist
def test_two_gloo_ranks_follow_the_hand_written_delayed_rule(tmp_path, reference):
    fork_ranks(_rank_main, 2, tmp_path)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name in DIST:
            assert results[name]["losses"] == pytest.approx(reference[0], rel=RTOL), (rank, name)
            assert_params_close(results[name]["params"], reference[1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_estimate_counts_the_host_bytes_the_engine_holds(dtype):
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.tiers import format_tier_estimate, input_tiers

    recipe, engine, _ = tiny_engine(1, ["zero.stage=2", f"precision.dtype={dtype}", *DELAYED])
    inp = EstimateInput.from_recipe(recipe)
    exact = input_tiers(EstimateInput.from_recipe(tiny_engine(1, ["zero.stage=2", f"precision.dtype={dtype}",
                                                                   "zero.offload_optimizer=cpu"])[0]))
    numel = engine.strategy.layout.numel
    extra = input_tiers(inp).cpu - exact.cpu
    assert extra == 2 * (4 + {"fp32": 4, "bf16": 2}[dtype]) * numel  # as the engine's buffers, below
    held = sum(t.untyped_storage().nbytes() for t in engine.strategy.parts[-1].delayed.host_tensors())
    assert extra == held
    assert "<- recipe" in format_tier_estimate(inp)


def test_a_delay_that_starts_inside_the_lr_warm_up_is_warned_with_the_fix():
    from tests.conftest import run_cli

    base = ["validate", "quickstart", "zero.stage=1", "zero.offload_optimizer=cpu", "zero.offload_update=delayed"]
    early = run_cli(*base, "zero.offload_update_warmup=5")  # the quickstart's lr warms up for 20 steps
    assert early.returncode == 0
    assert ("warning: recipe.zero.offload_update_warmup: 5 is shorter than scheduler.warmup_num_steps 20"
            in early.stderr), early.stderr
    assert "offload_update_warmup" not in run_cli(*base, "zero.offload_update_warmup=20").stderr
