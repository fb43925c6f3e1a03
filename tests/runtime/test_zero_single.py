"""ZeRO in one process (no process group, no launcher): every stage, with and
without offload and accumulation, ends where stage 0 does; the tolerance and its
reason are those of tests/runtime/zero_helpers.py."""
import pytest
import torch

from tests.runtime.zero_helpers import (RTOL, SMALL_BUCKETS, STEPS, assert_params_close, save_and_resume,
                                        tiny_engine, train)


@pytest.fixture(scope="module")
def stage0():
    engine, _, losses, _ = train(1, ["zero.stage=0"])
    return engine.strategy.full_parameters(), losses


@pytest.mark.parametrize("overrides", [["zero.stage=1"], ["zero.stage=2", "batch.grad_accum_steps=2"],
                                       ["zero.stage=3"], ["zero.stage=3", "zero.offload_optimizer=cpu"],
                                       ["zero.stage=1", "zero.offload_optimizer=cpu"]], ids=" ".join)
def test_one_process_zero_stage_matches_stage0(overrides, stage0):
    engine, _, losses, _ = train(1, overrides)
    assert engine.dist.world_size == 1 and engine.dist.backend is None
    assert_params_close(engine.strategy.full_parameters(), stage0[0])
    assert losses == pytest.approx(stage0[1], rel=RTOL)
    assert len(losses) == STEPS


PART_OFFLOAD = ["zero.offload_optimizer=cpu", "zero.offload_ratio=0.5"]


@pytest.mark.parametrize("overrides", [["zero.stage=2", SMALL_BUCKETS, *PART_OFFLOAD], ["zero.stage=3", *PART_OFFLOAD]],
                         ids=" ".join)
def test_part_offloaded_optimizer_matches_stage0(overrides, stage0, monkeypatch):
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)  # many pieces: the staging slots alternate
    engine, _, losses, _ = train(1, overrides)
    assert len(engine.strategy.parts[1].offloaded_step.pieces) > 10
    kept, offloaded = engine.strategy.parts
    assert not kept.offloaded and offloaded.offloaded and kept.layout.numel and offloaded.layout.numel
    share = offloaded.layout.numel / engine.strategy.layout.numel
    assert 0.2 < share < 0.8  # whole groups, about half the shard
    memory = engine.strategy.memory_bytes()
    assert memory["mem_offload_bytes"] == 12 * offloaded.layout.numel  # fp32: master + moments
    assert memory["mem_optim_bytes"] == 8 * kept.layout.numel and memory["mem_master_bytes"] == 0
    assert_params_close(engine.strategy.full_parameters(), stage0[0])
    assert losses == pytest.approx(stage0[1], rel=RTOL)


def test_checkpoint_moves_between_part_and_whole_offload(tmp_path):
    """Saved with half the optimizer offloaded, resumed with all of it offloaded: same states, same losses."""
    saved, restored, uninterrupted, resumed, engine = save_and_resume(
        tmp_path / "run", ["zero.stage=2", SMALL_BUCKETS, *PART_OFFLOAD],
        ["zero.stage=2", SMALL_BUCKETS, "zero.offload_optimizer=cpu"])
    assert len(engine.strategy.parts) == 1
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert resumed == pytest.approx(uninterrupted, rel=RTOL)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_memory_per_rank_matches_the_toolkit_estimate(stage):
    from toolkit.observe.estimate import estimate_model_state_bytes

    engine, _, _, _ = train(1, [f"zero.stage={stage}", "precision.dtype=bf16", SMALL_BUCKETS], steps=1)
    live = engine.strategy.memory_bytes()
    want = estimate_model_state_bytes(engine.num_parameters, stage=stage, world_size=1, dtype="bf16")
    assert live["mem_params_bytes"] == pytest.approx(want.params, rel=0.05)
    assert live["mem_grads_bytes"] == pytest.approx(want.grads, rel=0.05)
    assert live["mem_optim_bytes"] + live["mem_master_bytes"] == pytest.approx(want.optim, rel=0.05)


def test_one_process_stage0_frees_gradients_and_accumulates_exactly():
    """One process holds no gradient buckets: gradients are dropped after each step (the next backward
    writes them instead of adding into zeros), and two accumulated micro-steps sum bitwise as they did."""
    _, engine, stream = tiny_engine(1, ["zero.stage=0", "batch.grad_accum_steps=2"])
    first, second = stream.next_step()
    engine.backward(engine(first))
    after_one = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    engine.backward(engine(second))
    summed = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    engine.step()
    assert all(p.grad is None for p in engine.model.parameters())
    _, fresh, stream = tiny_engine(1, ["zero.stage=0", "batch.grad_accum_steps=2"])
    first, second = stream.next_step()
    fresh.backward(fresh(second))
    for name, p in fresh.model.named_parameters():
        assert torch.equal(after_one[name] + p.grad, summed[name]), name
    param_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert engine.strategy.memory_bytes()["mem_grads_bytes"] == param_bytes
