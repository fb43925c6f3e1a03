"""One optimizer factory (toolkit/runtime/optim.py build_optimizer) for every strategy: the mesh honours
optimizer.type and optimizer.implementation as stage 0 does, 1-bit Adam under the mesh is refused in one
line, and the deprecated kernels.adamw reads as optimizer.implementation."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from toolkit.distributed import DistInfo
from toolkit.runtime.parallel.strategy import MeshStrategy
from toolkit.specs import OptimizerSpec

ONE_PROCESS = DistInfo(rank=0, world_size=1, local_rank=0, backend=None)
# The mesh's coordinates for a one-process strategy at zero.stage 0 (only stage 1 asks for a process group).
MESH = SimpleNamespace(tp_rank=0, pp_rank=0, dp_rank=0, dp=1, tp=1, pp=1)


def spec(type_="adamw", implementation="torch") -> OptimizerSpec:
    return OptimizerSpec(type=type_, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                         implementation=implementation)


def mesh_strategy(optimizer: OptimizerSpec, adamw: str = "torch") -> MeshStrategy:
    """A one-process mesh strategy at zero.stage 0 over a small model; `adamw` is the engine's choice."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return MeshStrategy(model, optimizer, 0, torch.device("cpu"), ONE_PROCESS, MESH, {}, shapes, adamw)


@pytest.mark.parametrize("type_, cls", [("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)])
def test_the_mesh_steps_with_the_optimizer_the_recipe_names(type_, cls):
    optimizer = mesh_strategy(spec(type_)).optimizer
    assert type(optimizer) is cls
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_the_mesh_steps_with_the_adamw_the_engine_chose():
    # the engine chooses it from optimizer.implementation for the mesh as for stage 0 (choose_adamw)
    assert mesh_strategy(spec(), "torch-fused").optimizer.defaults["fused"] is True
    assert not mesh_strategy(spec(), "torch").optimizer.defaults["fused"]


def test_onebit_adam_under_a_mesh_is_refused_in_one_line():
    from toolkit.recipe.load import RecipeError, load_recipe

    with pytest.raises(RecipeError) as caught:
        load_recipe("quickstart", ["parallel.tensor=2", "optimizer.type=onebit_adam"], world_size=4)
    assert caught.value.lines == [  # a UserError: the CLI prints it and exits 2
        "recipe.optimizer.type: 'onebit_adam' runs on zero.stage 0 in fp32 or bf16, not with parallel.tensor/pipeline "
        "> 1 (as DeepSpeed's 1-bit Adam, it replaces stage 0's gradient all-reduce); use 'adamw' there"]


@pytest.mark.parametrize("implementation, kernel, expected", [
    ("auto", "auto", "auto"), ("auto", "off", "torch_fused"), ("fused", "off", "torch_fused"),
    ("torch", "off", "torch"), ("auto", "on", "auto"), ("torch_fused", "on", "torch_fused")])
def test_the_deprecated_kernels_adamw_reads_as_optimizer_implementation(implementation, kernel, expected):
    from toolkit.runtime.optim import adamw_implementation
    from toolkit.specs import KernelsSpec

    kernels = KernelsSpec(adamw=kernel, layernorm="auto", rmsnorm="auto", bias_gelu="auto", cross_entropy="auto")
    assert adamw_implementation(spec(implementation=implementation), kernels) == expected


def test_kernels_adamw_gets_a_one_line_deprecation_warning_naming_both_keys():
    from toolkit.recipe.load import load_recipe

    assert not [w for w in load_recipe("quickstart").warnings if "kernels.adamw" in w]
    warned = [w for w in load_recipe("quickstart", ["kernels.adamw=off"]).warnings if "kernels.adamw" in w]
    assert warned == ["recipe.kernels.adamw: deprecated, recipe.optimizer.implementation decides the AdamW; "
                      "'off' reads as optimizer.implementation 'torch_fused'"]


def test_muon_is_one_branch_whole_tensors_get_torchs_muon_beside_torchs_adamw_and_a_shard_the_gathering_step():
    from toolkit.runtime.muon import MuonAdamW
    from toolkit.runtime.optim import FlatShard, adamw_kernel_applies, build_optimizer, optimizer_param_groups
    from toolkit.runtime.zero.flat import FlatGroup, ShardLayout
    from toolkit.runtime.zero.muon import ShardedMuon

    muon = OptimizerSpec(type="muon", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="auto")
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    groups = optimizer_param_groups(model, muon)
    # Muon: the Linear's weight; AdamW: the embedding (decayed), the bias and the norm (not)
    assert [[tuple(p.shape) for p in g["params"]] for g in groups] == [[(4, 4)], [(8, 4)], [(4,), (4,), (4,)]]
    whole = build_optimizer(muon, groups, "toolkit-fused")
    assert isinstance(whole, MuonAdamW) and isinstance(whole._muon, torch.optim.Muon)
    assert [g.get("fused") for g in whole.param_groups[1:]] == [True, True]  # torch's fused AdamW, not the kernel
    assert not adamw_kernel_applies("auto", 0, optimizer_type="muon")  # so the engine builds no kernel for it
    layout = ShardLayout([FlatGroup(list(model.named_parameters()), {id(model[1].weight)}, 1)], 0)
    shard = build_optimizer(muon, FlatShard(layout.numel, torch.device("cpu"), False, layout, None))
    assert isinstance(shard, ShardedMuon) and shard.param_groups[0]["muon"]


@pytest.mark.parametrize("type_, l2", [("adamw", False), ("adam", True)])
def test_state_dtype_bf16_builds_the_bf16_state_adamw_over_whole_tensors(type_, l2):
    from dataclasses import replace

    from toolkit.runtime.low_precision_adamw import BF16AdamW
    from toolkit.runtime.optim import build_optimizer, param_groups

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(torch.bfloat16)
    optimizer = build_optimizer(replace(spec(type_), state_dtype="bf16"), param_groups(model, 0.1), "torch-fused")
    assert type(optimizer) is BF16AdamW and optimizer.l2 is l2
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert type(build_optimizer(spec(type_), param_groups(model.float(), 0.1))) is not BF16AdamW


@pytest.mark.parametrize("type_, l2", [("adamw", False), ("adam", True)])
def test_state_dtype_int8_builds_int8_adamw_over_whole_tensors_and_int8_moments_over_a_shard(type_, l2):
    from dataclasses import replace

    from toolkit.runtime.int8_adamw import Int8AdamW
    from toolkit.runtime.optim import FlatShard, adamw_kernel_applies, build_optimizer, param_groups
    from toolkit.runtime.zero.adamw import ShardedAdamW

    int8 = replace(spec(type_), state_dtype="int8")
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = build_optimizer(int8, param_groups(model, 0.1), "torch-fused")
    assert type(optimizer) is Int8AdamW and optimizer.l2 is l2
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.moments.numel == 28  # held from the start: the start-up table's tiers row counts it
    shard = build_optimizer(int8, FlatShard(300, torch.device("cpu"), False))
    assert type(shard) is ShardedAdamW and shard.mode == "int8 blockwise moments"
    assert [t.numel() for t in shard.moment_tensors()] == [300, 2, 300, 2]
    assert not adamw_kernel_applies("auto", 0, state_dtype="int8")  # the engine builds no CUDA AdamW for it
    assert not adamw_kernel_applies("auto", 0, state_dtype="bf16") and adamw_kernel_applies("auto", 0)
