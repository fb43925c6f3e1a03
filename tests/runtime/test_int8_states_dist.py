"""optimizer.state_dtype int8 on 2 and 4 gloo ranks: stages 1-3 against stage 0 over 10 steps, and a checkpoint
saved at world 2 (stage 2) resumed at world 4 (stage 3) and in one process (stage 0). One launch per world size
runs every check (tests/runtime/test_zero_dist.py's pattern); the assertions run here.

Tolerance: 1e-4 relative in loss. The shard's blocks (256 elements of the rank's shard) move with the stage and
the world size, so a block's absmax and its codes differ between runs. Measured over 10 steps: stages 1-3 against
stage 0 within 2.4e-5 (2 ranks) and 2.8e-5 (4 ranks), stage 0 at 2 and 4 ranks against one process within 2.7e-7,
the world 4 resume against world 2's own run within 2.7e-6. A 10% lr error moves the loss 2.1e-3, fp32 states
3.3e-5 (so these checks see the stages, not the moments' format: test_int8_states.py checks that).
"""
import pytest
import torch

from tests.conftest import become_rank, leave_rank
from tests.runtime.zero_helpers import SMALL_BUCKETS, STEPS, spawn_ranks, tiny_engine, train

pytestmark = pytest.mark.dist

INT8 = ["optimizer.state_dtype=int8", SMALL_BUCKETS]
SAVING = {2: ["zero.stage=2", *INT8], 4: ["zero.stage=3", *INT8]}


def _save_or_resume(world, out_dir, results):
    """World 2 trains 10 steps saving after step 5; world 4 resumes world 2's checkpoint and trains to 10."""
    from toolkit.checkpoint.checkpointer import Checkpointer, restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    if world == 2:
        recipe, engine, stream = tiny_engine(world, SAVING[2])
        checkpointer = Checkpointer(recipe, out_dir / "world2", engine, stream)
        results["uninterrupted"] = []
        for step in range(STEPS):
            results["uninterrupted"].append(engine.train_batch(stream.next_step()).loss)
            if step == 4:
                checkpointer.save()
        return
    ckpt = load_checkpoint(find_checkpoint(out_dir / "world2"))
    _, engine, stream = tiny_engine(world, SAVING[4])
    restore_engine_and_stream(ckpt, engine, stream)
    results["resumed"] = [engine.train_batch(stream.next_step()).loss for _ in range(STEPS - ckpt.step)]
    results["step_count"] = engine.strategy.optimizer_steps()


def _rank_main(rank, world, port, out_dir):
    become_rank(rank, world, port)
    results = {}
    for stage in range(4):
        engine, _, losses, _ = train(world, [f"zero.stage={stage}", *INT8])
        results[stage] = {"losses": losses, "optim_bytes": engine.strategy.memory_bytes()["mem_optim_bytes"]}
    _save_or_resume(world, out_dir, results)
    torch.save(results, out_dir / f"rank{rank}-of-{world}.pt")
    leave_rank()


def launch(world, out_dir):
    return spawn_ranks(_rank_main, world, lambda r: out_dir / f"rank{r}-of-{world}.pt", out_dir)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("int8-ckpt")


@pytest.fixture(scope="module")
def world2(ckpt_dir):
    return launch(2, ckpt_dir)


@pytest.fixture(scope="module")
def world4(ckpt_dir, world2):
    return launch(4, ckpt_dir)


@pytest.fixture(scope="module")
def one_process():
    return train(1, ["zero.stage=0", *INT8])[2]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_with_int8_moments_match_stage_0_after_ten_steps(world, stage, world2, world4, one_process):
    ranks = {2: world2, 4: world4}[world]
    stage0 = ranks[0][0]["losses"]
    assert stage0 == pytest.approx(one_process, rel=1e-4)
    assert ranks[0][stage]["losses"] == pytest.approx(stage0, rel=1e-4)
    assert ranks[0][stage]["losses"][-1] < stage0[0] - 0.2  # and it learns


def test_each_rank_holds_int8_moments_of_its_shard_only(world2, world4):
    """Stage 1's moments per rank: 2 bytes per shard element plus 8 per 256, about 1/world of stage 0's."""
    for ranks in (world2, world4):
        stage0, stage1 = ranks[0][0]["optim_bytes"], ranks[0][1]["optim_bytes"]
        assert stage1 < stage0 / len(ranks) * 1.05


def test_a_world_2_checkpoint_resumes_at_world_4_and_continues(world2, world4):
    for rank in world4:
        assert rank["step_count"] == STEPS
    assert world4[0]["resumed"] == pytest.approx(world2[0]["uninterrupted"][5:], rel=1e-4)


def test_a_world_2_checkpoint_resumes_in_one_process_at_stage_0(ckpt_dir, world2):
    """The moments come back within one code step (of the absmax of the block they land in) of the saved ones."""
    from toolkit.checkpoint.checkpointer import restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint
    from toolkit.checkpoint.zero_shards import ShardFilesReader
    from toolkit.runtime.int8_moments import SIGNED_MAP

    ckpt = load_checkpoint(find_checkpoint(ckpt_dir / "world2"))
    _, engine, stream = tiny_engine(1, ["zero.stage=0", *INT8])
    restore_engine_and_stream(ckpt, engine, stream)
    zero = ckpt.state["engine"]["zero"]
    reader = ShardFilesReader(ckpt.path, zero["files"], zero["step"])
    states = engine.optimizer.fp32_states()
    saved = {name: reader.read("exp_avg", name, 0, p.numel()) for name, p in engine.model.named_parameters()}
    largest = max(float(v.abs().max()) for v in saved.values())
    half_gap = float((SIGNED_MAP[1:] - SIGNED_MAP[:-1]).max()) / 2
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach().reshape(-1), reader.read("param", name, 0, p.numel()))
        assert float((states[p]["exp_avg"].reshape(-1) - saved[name]).abs().max()) <= half_gap * largest
    reader.close()
    resumed = [engine.train_batch(stream.next_step()).loss for _ in range(STEPS - ckpt.step)]
    assert resumed == pytest.approx(world2[0]["uninterrupted"][5:], rel=1e-4)
