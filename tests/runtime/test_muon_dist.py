"""Muon at ZeRO 0-3 on gloo (CPU, fp32) at world sizes 2 and 4, one torch.multiprocessing launch per world size:
10 steps per stage (stage 2 also with gradient accumulation) against the one-process Muon, the ledger's bytes against the strategy's formula (with
Muon's all-gather of the updates), and checkpoints: resumed at the same world size bit for bit, and
resharded from world 2 (stage 2) to world 4 (stage 3) and to one process.

Tolerance: tests/runtime/zero_helpers.py (rtol = atol = 1e-5), for runs with muon_ns_dtype fp32. The default
bf16 Newton-Schulz (torch's) turns the last-bit gradient differences of another world size into ~1e-3 after
10 steps (tests/runtime/test_muon.py says why); that run is held to 1e-2, which a real bug (a missing
gather, a wrong slice: ~lr = 0.02 per step) exceeds.
"""
import pytest
import torch

from tests.conftest import become_rank, leave_rank
from tests.runtime.zero_helpers import STEPS, assert_params_close, spawn_ranks, tiny_engine, train, train_and_save

pytestmark = pytest.mark.dist

MUON = ["optimizer.type=muon", "optimizer.muon_lr=0.02", "optimizer.muon_weight_decay=0.1",
        "zero.reduce_bucket_size=20000"]
FP32 = [*MUON, "optimizer.muon_ns_dtype=fp32"]
SAVE_AT = 4  # the checkpoint holds 5 steps


def _steps_with_bytes(world, overrides):
    _, engine, stream = tiny_engine(world, overrides)
    expected = engine.strategy.expected_bytes_per_step(engine.grad_accum_steps)
    results = [engine.train_batch(stream.next_step()) for _ in range(STEPS)]
    return {"params": engine.strategy.full_parameters(), "losses": [r.loss for r in results],
            "comm": [r.comm for r in results], "expected": expected}


def _save_and_resume(world, out_dir):
    """World 2 (stage 2): 10 steps saving after 5, then resume its own checkpoint. World 4 (stage 3): resume
    world 2's checkpoint. Each resumed run continues to step 10."""
    from toolkit.checkpoint.checkpointer import restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    overrides = [*FP32, "zero.stage=2" if world == 2 else "zero.stage=3"]
    results = {}
    if world == 2:
        engine, losses, _ = train_and_save(world, overrides, out_dir, SAVE_AT)
        results["uninterrupted"] = {"losses": losses, "params": engine.strategy.full_parameters()}
    ckpt = load_checkpoint(find_checkpoint(out_dir))
    _, engine, stream = tiny_engine(world, overrides)
    restore_engine_and_stream(ckpt, engine, stream)
    results["max_state_diff"] = _max_state_diff(engine, ckpt)
    losses = [engine.train_batch(stream.next_step()).loss for _ in range(STEPS - ckpt.step)]
    results["resumed"] = {"losses": losses, "params": engine.strategy.full_parameters(),
                          "step_count": engine.strategy.optimizer_steps()}
    return results


def _max_state_diff(engine, ckpt) -> float:
    """Largest difference between the restored shard (weights, momentum, moments) and the checkpoint's files."""
    from toolkit.checkpoint.zero_shards import ShardFilesReader

    zero = ckpt.state["engine"]["zero"]
    reader = ShardFilesReader(ckpt.path, zero["files"], zero["step"])
    worst = max(float((view - reader.read(kind, name, a, b)).abs().max())
                for name, a, b, views in engine.strategy.owned_pieces() for kind, view in views.items())
    reader.close()
    return worst


def _rank_main(rank, world, port, out_dir):
    become_rank(rank, world, port)
    results = {f"stage{stage}": _steps_with_bytes(world, [*FP32, f"zero.stage={stage}"]) for stage in (0, 1, 2, 3)}
    results["stage2-accum2"] = _steps_with_bytes(world, [*FP32, "zero.stage=2", "batch.grad_accum_steps=2"])
    results["stage2-bf16"] = _steps_with_bytes(world, [*MUON, "zero.stage=2"])
    for stage in (2, 3):  # offloaded: momentum, moments and master in CPU memory
        results[f"stage{stage}-offload"] = _steps_with_bytes(world, [*FP32, f"zero.stage={stage}",
                                                                     "zero.offload_optimizer=cpu"])
    # half the shard offloaded (offload_ratio 0.5): a device part and a CPU part, one schedule for both
    results["stage2-offload-half"] = _steps_with_bytes(world, [*FP32, "zero.stage=2", "zero.offload_optimizer=cpu",
                                                               "zero.offload_ratio=0.5"])
    # in swap files (zero.offload_optimizer nvme), streamed a piece at a time
    results["stage3-nvme"] = _steps_with_bytes(world, [*FP32, "zero.stage=3", "zero.offload_optimizer=nvme",
                                                       f"zero.nvme_path={out_dir.parent}"])
    results["checkpoint"] = _save_and_resume(world, out_dir)
    torch.save(results, out_dir.parent / f"muon-rank{rank}-of-{world}.pt")
    leave_rank()


def launch(world, out_dir):
    return spawn_ranks(_rank_main, world, lambda r: out_dir.parent / f"muon-rank{r}-of-{world}.pt", out_dir)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("muon") / "ckpt"


@pytest.fixture(scope="module")
def world2(ckpt_dir):
    return launch(2, ckpt_dir)


@pytest.fixture(scope="module")
def world4(ckpt_dir, world2):  # resumes world 2's checkpoint
    return launch(4, ckpt_dir)


@pytest.fixture(scope="module")
def one_process():
    return {dtype: train(1, [*overrides, "zero.stage=0"])[0].strategy.full_parameters()
            for dtype, overrides in (("fp32", FP32), ("bf16", MUON))}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3", "stage2-accum2", "stage2-offload",
                                  "stage3-offload", "stage2-offload-half", "stage3-nvme"])
def test_muon_at_zero_stage_matches_one_process_muon_after_ten_steps(world, name, world2, world4, one_process):
    ranks = {2: world2, 4: world4}[world]
    for rank in ranks:  # every rank ends with the same whole parameters, those of one process
        assert_params_close(rank[name]["params"], one_process["fp32"])


@pytest.mark.parametrize("world", [2, 4])
def test_torch_bf16_newton_schulz_at_zero_2_stays_within_its_stated_drift(world, world2, world4, one_process):
    got = {2: world2, 4: world4}[world][0]["stage2-bf16"]["params"]
    worst = max(float((got[n] - want).abs().max()) for n, want in one_process["bf16"].items())
    assert worst < 1e-2


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["stage1", "stage2", "stage3", "stage2-accum2", "stage2-bf16"])
def test_measured_bytes_per_step_equal_the_formula_with_muons_gather(world, name, world2, world4):
    from toolkit.observe.comm_ledger import wire_bytes

    for rank in {2: world2, 4: world4}[world]:
        got = rank[name]
        scalars = wire_bytes("all_reduce", 8, world) * 2  # the loss and the grad norm
        for step in got["comm"]:
            assert step["comm_bytes"] == sum(got["expected"].values()) + scalars
    # Muon's gather adds to the weights' all-gather at stages 1-2: bf16 updates are half of fp32 weights
    plain = {2: world2, 4: world4}[world][0]["stage1"]["expected"]
    assert plain["all_gather"] > plain["reduce_scatter"]


def test_resume_at_world_2_is_bit_exact(world2):
    for rank in world2:
        done = rank["checkpoint"]
        assert done["max_state_diff"] == 0.0
        assert done["resumed"]["losses"] == done["uninterrupted"]["losses"][SAVE_AT + 1:]
        for name, want in done["uninterrupted"]["params"].items():
            assert torch.equal(done["resumed"]["params"][name], want), name


def test_resume_at_world_4_from_world_2_restores_states_and_continues(world2, world4):
    want = world2[0]["checkpoint"]["uninterrupted"]
    for rank in world4:
        done = rank["checkpoint"]
        assert done["max_state_diff"] == 0.0 and done["resumed"]["step_count"] == STEPS
        assert_params_close(done["resumed"]["params"], want["params"])
    assert world4[0]["checkpoint"]["resumed"]["losses"] == pytest.approx(want["losses"][SAVE_AT + 1:], rel=1e-5)


def test_resume_in_one_process_from_world_2(ckpt_dir, world2):
    from toolkit.checkpoint.checkpointer import restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    ckpt = load_checkpoint(find_checkpoint(ckpt_dir))
    _, engine, stream = tiny_engine(1, [*FP32, "zero.stage=2"])
    restore_engine_and_stream(ckpt, engine, stream)
    assert _max_state_diff(engine, ckpt) == 0.0
    losses = [engine.train_batch(stream.next_step()).loss for _ in range(STEPS - ckpt.step)]
    want = world2[0]["checkpoint"]["uninterrupted"]
    assert losses == pytest.approx(want["losses"][SAVE_AT + 1:], rel=1e-5)
    assert_params_close(engine.strategy.full_parameters(), want["params"])
