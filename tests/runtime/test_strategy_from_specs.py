"""Every strategy builds from specs alone (no Recipe: docs' "Seams"), in one process, and is a `Strategy`
(toolkit/runtime/strategy.py) with the members the engine, checkpoints, the ledger and the loop ask for."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from toolkit.distributed import DistInfo
from toolkit.runtime.communicator import Communicator
from toolkit.runtime.parallel.strategy import MeshStrategy
from toolkit.runtime.strategy import Strategy
from toolkit.runtime.zero import build_strategy
from toolkit.runtime.zero.onebit_adam import OnebitAdamStrategy
from toolkit.specs import OptimizerSpec, ZeroSpec

CPU = torch.device("cpu")
ONE = DistInfo(rank=0, world_size=1, local_rank=0, backend=None)
OPTIMIZER = OptimizerSpec(type="adamw", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, implementation="torch")


def zero(stage: int, offload: str = "none") -> ZeroSpec:
    return ZeroSpec(stage=stage, offload_optimizer=offload, offload_ratio=1.0, offload_param="none", nvme_path=None,
                    reduce_bucket_size=64, allgather_bucket_size=64, prefetch_units=1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def train_step(strategy: Strategy, net: nn.Module) -> float:
    """One micro step and one optimizer step as the engine drives them; the loss."""
    loss = net(torch.ones(2, 8)).square().mean()
    strategy.begin_micro_step(boundary=True)
    loss.backward()
    strategy.end_micro_step()
    assert not strategy.grads_overflow()
    strategy.clip_grad_norm(1.0)
    strategy.optimizer_step()
    strategy.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize("stage, offload", [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu")])
def test_a_zero_strategy_builds_from_specs_and_trains(stage, offload):
    net = model()
    strategy = build_strategy(net, zero(stage, offload), OPTIMIZER, "fp32", CPU, ONE, adamw="torch",
                              comm=Communicator(ONE, CPU))
    assert isinstance(strategy, Strategy) and strategy.stage == stage and strategy.offload == (offload != "none")
    assert strategy.sharded_checkpoint == (stage > 0) and strategy.extra_state() == {}
    first = train_step(strategy, net)
    assert train_step(strategy, net) < first  # the optimizer stepped the weights downhill
    assert strategy.optimizer_steps() == 2 and strategy.data_rank == 0
    assert set(strategy.expected_bytes_per_step(1)) <= {"all_reduce", "reduce_scatter", "all_gather"}
    assert "params" in strategy.describe_tiers()


def test_onebit_adam_builds_from_specs():
    # NOTE: two ranks described, none joined: building issues no collective (build_strategy's broadcast does)
    two = DistInfo(rank=0, world_size=2, local_rank=0, backend="gloo")
    spec = OptimizerSpec(type="onebit_adam", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                         implementation="torch", freeze_step=3)
    strategy = OnebitAdamStrategy(model(), zero(0), spec, CPU, two, Communicator(two, CPU))
    assert isinstance(strategy, Strategy) and not strategy.sharded_checkpoint
    assert set(strategy.extra_state()) == {"worker_error", "server_error"} and strategy.freeze_step == 3
    assert set(strategy.expected_bytes_per_step(1)) == {"all_to_all", "all_gather"}


def test_the_mesh_strategy_builds_from_specs():
    # NOTE: its clipping all-reduces over the whole mesh, so it trains only in a process group
    # (tests/runtime/test_parallel_dist.py); a one-process mesh at stage 0 needs none to be built.
    net = model()
    mesh = SimpleNamespace(tp_rank=0, pp_rank=0, dp_rank=1, dp=2, tp=1, pp=1)
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    strategy = MeshStrategy(net, OPTIMIZER, 0, CPU, ONE, mesh, {}, shapes, "torch")
    assert isinstance(strategy, Strategy) and strategy.sharded_checkpoint and strategy.expected_bytes_per_step(1) == {}
    assert strategy.data_rank == 1 and strategy.param_shapes() == shapes  # the mesh's dp rank picks the data
