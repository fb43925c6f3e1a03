"""What converted DeepSpeed configs need beyond AdamW and the warmup schedules: OneCycle (with DeepSpeed's
momentum cycling) and LRRangeTest against DeepSpeed's classes transcribed (tests/oracles/deepspeed.py), and
optimizer.type adam (L2 weight decay) in every ZeRO stage against torch.optim.Adam at stage 0."""
import pytest
import torch

from tests.oracles import deepspeed
from tests.runtime.zero_helpers import RTOL, assert_params_close, train
from toolkit.recipe.load import recipe_from_dict
from toolkit.runtime.optim import Schedule, betas_at, lr_at

BASE = {"model": {}, "data": {}, "batch": {"micro_batch_per_rank": 1}, "training": {"max_steps": 10}}
ONE_CYCLE = {"type": "OneCycle", "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5,
             "cycle_second_step_size": 3, "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85,
             "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}


def _spec(scheduler: dict):
    return recipe_from_dict({**BASE, "scheduler": scheduler}).scheduler


@pytest.mark.parametrize("params", [ONE_CYCLE, {**ONE_CYCLE, "decay_step_size": 0, "cycle_momentum": False},
                                    {"type": "OneCycle", "cycle_min_lr": 0.002, "cycle_max_lr": 0.005}],
                         ids=["decay", "no-decay-no-momentum", "defaults"])
def test_one_cycle_lr_and_betas_equal_deepspeed_for_every_step(params):
    spec = _spec(params)
    oracle = deepspeed.OneCycle(**{k: v for k, v in params.items() if k != "type"})
    for iteration in range(-1, 30):
        assert lr_at(spec, 1.0, iteration) == pytest.approx(oracle.lr, rel=1e-12), iteration
        expected = oracle.betas if oracle.cycle_momentum else None
        assert betas_at(spec, iteration) == (pytest.approx(expected, rel=1e-12) if expected else None), iteration
        oracle.step()


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_equals_deepspeed_for_every_step(staircase):
    params = {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 5,
              "lr_range_test_staircase": staircase}
    spec, oracle = _spec({"type": "LRRangeTest", **params}), deepspeed.LRRangeTest(**params)
    for iteration in range(-1, 20):
        assert lr_at(spec, 1.0, iteration) == pytest.approx(oracle.lr, rel=1e-12), iteration
        oracle.step()


def test_one_cycle_without_its_bounds_names_them():
    from toolkit.recipe.schema import RecipeError

    with pytest.raises(RecipeError, match="cycle_min_lr and cycle_max_lr"):
        _spec({"type": "OneCycle"})


def test_schedule_writes_one_cycle_betas_into_torch_adam_groups():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=1.0)
    schedule = Schedule(opt, _spec(ONE_CYCLE), 1.0)
    assert opt.param_groups[0]["betas"] == (0.85, 0.99)  # DeepSpeed's constructor: cycle_min_mom, beta2 0.99
    schedule.step()
    assert opt.param_groups[0]["betas"] == pytest.approx(betas_at(schedule.spec, 0))


ADAM = ["optimizer.type=adam", "optimizer.weight_decay=0.1"]


@pytest.fixture(scope="module")
def adam_stage0():
    engine, _, losses, _ = train(1, ["zero.stage=0", *ADAM])
    assert type(engine.optimizer) is torch.optim.Adam
    return engine.strategy.full_parameters(), losses


@pytest.mark.parametrize("overrides", [["zero.stage=2"], ["zero.stage=1", "zero.offload_optimizer=cpu"]],
                         ids=" ".join)
def test_adam_with_l2_decay_matches_torch_adam_in_zero_stages(overrides, adam_stage0):
    engine, _, losses, _ = train(1, [*overrides, *ADAM])
    assert_params_close(engine.strategy.full_parameters(), adam_stage0[0])
    assert losses == pytest.approx(adam_stage0[1], rel=RTOL)


def test_adam_l2_differs_from_adamw(adam_stage0):
    _, _, losses, _ = train(1, ["zero.stage=0", "optimizer.weight_decay=0.1"])
    assert losses[-1] != pytest.approx(adam_stage0[1][-1], rel=1e-6)  # the decay really is applied differently
