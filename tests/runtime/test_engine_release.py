"""An engine dropped by its last reference frees its model and model states, so that a notebook, a sweep or a test
can build engine after engine in one process. torch keeps a parameter's hooks where Python's garbage collector does
not look: a strategy's bound method registered there used to keep every engine alive (tutorial 07's GPU sweep
measured the previous engines' model states in each later engine's peak)."""
import gc
import weakref

import pytest
import torch

from tests.conftest import become_rank, leave_rank
from tests.runtime.zero_helpers import spawn_ranks, train
from toolkit.runtime.strategy import weak_method_hook


class _Holder:
    """An object that holds a tensor and hooks one of its own methods onto it, as a strategy does."""

    def __init__(self, weight: torch.Tensor, weak: bool):
        self.weight = weight
        self.calls = 0
        weight.register_post_accumulate_grad_hook(weak_method_hook(self.hook) if weak else self.hook)

    def hook(self, param: torch.Tensor) -> None:
        self.calls += 1


def _alive_after_drop(weak: bool) -> tuple[bool, int]:
    holder = _Holder(torch.zeros(3, requires_grad=True), weak)
    (holder.weight * 2).sum().backward()
    calls, tensor = holder.calls, weakref.ref(holder.weight)
    del holder
    gc.collect()
    return tensor() is not None, calls


def test_a_strong_hook_on_a_tensor_is_a_cycle_the_collector_never_frees():
    """The torch behaviour the fix works around (if a torch release frees it, the weak hook is merely harmless)."""
    alive, calls = _alive_after_drop(weak=False)
    assert calls == 1
    assert alive


def test_the_weak_hook_runs_and_lets_the_tensor_go():
    alive, calls = _alive_after_drop(weak=True)
    assert calls == 1
    assert not alive


def _released(world: int, overrides: list[str]) -> bool:
    """Train 3 steps, drop the engine: is its first parameter gone?"""
    engine, stream, _, _ = train(world, overrides, steps=3)
    parameter = weakref.ref(next(engine.model.parameters()))
    del engine, stream
    gc.collect()
    return parameter() is None


@pytest.mark.parametrize("overrides", [
    ["zero.stage=1"], ["zero.stage=2"], ["zero.stage=3"],
    ["zero.stage=2", "zero.offload_optimizer=cpu"],
    ["zero.stage=2", "zero.offload_optimizer=cpu", "zero.offload_update=delayed", "zero.offload_update_warmup=1"],
    ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"],
], ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_a_dropped_engine_frees_its_model(overrides):
    assert _released(1, overrides)


def _rank_main(rank, world, port, out_dir):
    become_rank(rank, world, port)
    torch.save(_released(world, ["zero.stage=0"]), out_dir / f"rank{rank}.pt")
    leave_rank()


@pytest.mark.dist
def test_a_dropped_stage_0_engine_frees_its_model_on_2_ranks(tmp_path):
    """Stage 0 hooks its all-reduce onto the parameters only when there is another rank to reduce with."""
    assert spawn_ranks(_rank_main, 2, lambda r: tmp_path / f"rank{r}.pt", tmp_path) == [True, True]
