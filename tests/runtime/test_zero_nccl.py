"""Several GPUs over NCCL (issue #7): needs 2 or more CUDA devices, skipped otherwise.

One torch.multiprocessing launch over min(4, GPUs) ranks, one GPU each, trains the
tiny GPT-2 of tests/runtime/test_zero_dist.py for 20 steps per configuration:
- fp32 (TF32 off): stages 1-3, with and without CPU offload, equal stage 0 with
  tests/runtime/zero_helpers.py's tolerance (rtol 1e-5 + atol 1e-5; reasons there);
- bf16: stages 1-3 end within 2% of stage 0's losses. Stage 0 keeps fp32 weights under
  autocast while stages 1-3 keep bf16 weights beside the fp32 master, so their weights
  round differently every step; 2% is what that rounding drift stays under in 20 steps,
  a missing reduction or a stale shard moves the loss by far more (see test_zero_dist);
- a stage 2 checkpoint written at step 10 on N GPUs resumes in one process on one GPU
  with identical master weights and moments, and the same losses as the N-GPU run.
"""
import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import become_rank, free_port
from tests.runtime.zero_helpers import SMALL_BUCKETS, assert_params_close, tiny_engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                   reason="needs 2 or more GPUs")]
STEPS = 20
FP32 = {f"stage{s}{'-offload' if o else ''}": [f"zero.stage={s}", f"zero.offload_optimizer={'cpu' if o else 'none'}",
                                               SMALL_BUCKETS, f"training.max_steps={STEPS}"]
        for s, o in [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]}
BF16 = {f"bf16-stage{s}": [f"zero.stage={s}", "precision.dtype=bf16", SMALL_BUCKETS, f"training.max_steps={STEPS}"]
        for s in range(4)}


def _states(engine):
    return {(name, a, b, kind): view.detach().float().cpu().clone()
            for name, a, b, views in engine.strategy.owned_pieces() for kind, view in views.items()}


def _rank_main(rank, world, port, out_dir, device):
    become_rank(rank, world, port, NCCL_NVLS_ENABLE="0")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from toolkit.checkpoint.checkpointer import Checkpointer

    results = {}
    for name, overrides in {**FP32, **BF16}.items():
        recipe, engine, stream = tiny_engine(world, [f"training.device={device}", *overrides])
        checkpointer = Checkpointer(recipe, out_dir / "run", engine, stream) if name == "stage2" else None
        losses = []
        for step in range(STEPS):
            losses.append(engine.train_batch(stream.next_step()).loss)
            if checkpointer is not None and step == 9:
                checkpointer.save()
        results[name] = {"losses": losses, "params": {k: v.float().cpu() for k, v in
                                                      engine.strategy.full_parameters().items()}}
    torch.save(results, out_dir / f"rank{rank}.pt")
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def launch(world, out_dir, device="cuda"):
    mp.spawn(_rank_main, args=(world, free_port(), out_dir, device), nprocs=world, join=True)
    return torch.load(out_dir / "rank0.pt", weights_only=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nccl")
    return out, launch(min(4, torch.cuda.device_count()), out)


@pytest.mark.parametrize("name", [n for n in FP32 if n != "stage0"])
def test_fp32_stages_on_nccl_match_stage0(run, name):
    _, results = run
    assert_params_close(results[name]["params"], results["stage0"]["params"])
    assert results[name]["losses"] == pytest.approx(results["stage0"]["losses"], rel=1e-5)


@pytest.mark.parametrize("name", ["bf16-stage1", "bf16-stage2", "bf16-stage3"])
def test_bf16_stages_on_nccl_track_stage0(run, name):
    _, results = run
    assert results[name]["losses"] == pytest.approx(results["bf16-stage0"]["losses"], rel=0.02)


def test_checkpoint_from_n_gpus_resumes_on_one(run):
    from toolkit.checkpoint.checkpointer import restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    out, results = run
    ckpt = load_checkpoint(find_checkpoint(out / "run"))
    recipe, engine, stream = tiny_engine(1, ["training.device=cuda", *FP32["stage2"]])
    restore_engine_and_stream(ckpt, engine, stream)
    from toolkit.checkpoint.zero_shards import ShardFilesReader

    zero = ckpt.state["engine"]["zero"]
    reader = ShardFilesReader(ckpt.path, zero["files"], zero["step"])
    worst = max(float((view.float().cpu() - reader.read(kind, name, a, b)).abs().max())
                for name, a, b, views in engine.strategy.owned_pieces() for kind, view in views.items())
    reader.close()
    assert worst == 0.0
    losses = [engine.train_batch(stream.next_step()).loss for _ in range(STEPS - ckpt.step)]
    assert losses == pytest.approx(results["stage2"]["losses"][ckpt.step:], rel=1e-5)
