"""ZeRO in one process (no process group, no launcher): every stage, with and
without offload and accumulation, ends where stage 0 does; the tolerance and its
reason are those of tests/test_zero_dist.py."""
import pytest

from test_zero_dist import RTOL, STEPS, assert_params_close, train


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
