"""optimizer.type muon in the estimate (toolkit/observe/estimate.py, tiers.py) against the engine: Muon keeps one
fp32 momentum for each element of the blocks' matrices where AdamW keeps two moments, at every stage."""
import pytest
import torch

from tests.runtime.zero_helpers import tiny_engine

MUON = ["optimizer.type=muon"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_estimate_counts_the_matrices_the_engine_gives_muon(family):
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.runtime.muon import muon_param_ids

    recipe, engine, _ = tiny_engine(1, [*MUON, f"model.family={family}"])
    matrices = sum(p.numel() for p in engine.model.parameters() if id(p) in muon_param_ids(engine.model))
    assert EstimateInput.from_recipe(recipe).muon_params == matrices > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tier_bytes_with_muon_equal_what_the_engine_holds(stage, dtype):
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.tiers import input_tiers

    recipe, engine, stream = tiny_engine(1, [*MUON, f"zero.stage={stage}", f"precision.dtype={dtype}"])
    engine.train_batch(stream.next_step())
    mem = engine.strategy.memory_bytes()
    held = mem["mem_params_bytes"] + mem["mem_grads_bytes"] + mem["mem_optim_bytes"] + mem["mem_master_bytes"]
    inp = EstimateInput.from_recipe(recipe)
    assert input_tiers(inp, num_params=engine.num_parameters).gpu == held
    # against AdamW's layout: 4 bytes fewer per matrix element
    assert mem["mem_optim_bytes"] == 8 * engine.strategy.layout.numel - 4 * inp.muon_params


def test_stage_0_muon_state_is_one_momentum_per_matrix_and_two_moments_for_the_rest():
    from toolkit.observe.estimate_input import EstimateInput

    recipe, engine, stream = tiny_engine(1, [*MUON, "zero.stage=0"])
    engine.train_batch(stream.next_step())
    state = engine.optimizer.state
    moments = sum(t.numel() * 4 for s in state.values() for k, t in s.items() if k != "step")
    inp = EstimateInput.from_recipe(recipe)
    assert moments == 8 * engine.num_parameters - 4 * inp.muon_params
    # the estimate's optimizer column is the same (stage 0, fp32: the weights are their own master)
    assert inp.model_states(engine.num_parameters).optim == moments
    assert all(set(state[p]) == {"momentum_buffer"} for p in engine.optimizer.param_groups[0]["params"])
    assert isinstance(engine.optimizer, torch.optim.Optimizer)


@pytest.mark.parametrize("dtype, optimizer", [("fp32", "none"), ("fp32", "cpu"), ("bf16", "cpu")])
def test_tier_bytes_with_muon_and_the_parameters_in_cpu_memory_equal_what_the_engine_holds(dtype, optimizer):
    """Stage 3 with zero.offload_param cpu: the device keeps gradients and (unless offloaded) the optimizer with its
    own master; CPU memory the parameter shard, which under fp32 is the offloaded master too."""
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.tiers import input_tiers

    recipe, engine, stream = tiny_engine(1, [*MUON, "zero.stage=3", "zero.offload_param=cpu",
                                             f"zero.offload_optimizer={optimizer}", f"precision.dtype={dtype}"])
    engine.train_batch(stream.next_step())
    mem = engine.strategy.memory_bytes()
    want = input_tiers(EstimateInput.from_recipe(recipe), num_params=engine.num_parameters)
    assert want.gpu == mem["mem_params_bytes"] + mem["mem_grads_bytes"] + mem["mem_optim_bytes"] + mem["mem_master_bytes"]
    assert want.cpu == mem["mem_offload_bytes"]
