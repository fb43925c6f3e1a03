"""GPU: the ZeRO stages on CUDA. In one process, fp32, every stage (offload with the
pipelined CPU step, whole and half; ZeRO-Infinity's parameter and optimizer tiers, the
optimizer over three) ends where stage 0 does after 8 steps; then the same through an
NCCL process group of world size 1, so the collectives run on NCCL.

Tolerance: rtol 1e-5 on the losses, params within 2e-5 (TF32 is off; the GPU's
fused AdamW and the CPU kernel round the same fp32 maths in a different order)."""
import socket

import pytest
import torch

pytestmark = pytest.mark.cuda

STEPS = 8


def train(overrides):
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import load_recipe

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    engine = Engine(load_recipe("quickstart", ["training.device=cuda", "precision.dtype=fp32",
                                               "zero.reduce_bucket_size=20000", *overrides]))
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (engine.recipe.batch.micro_batch_per_rank, 65), generator=generator)
               for _ in range(STEPS)]
    losses = [engine.train_batch([batch]).loss for batch in batches]
    return engine, losses


def parameters(engine):
    if hasattr(engine.strategy, "full_parameters"):
        return engine.strategy.full_parameters()
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.fixture(scope="module")
def stage0():
    engine, losses = train(["zero.stage=0", "optimizer.implementation=torch_fused"])
    return parameters(engine), losses


CASES = [["zero.stage=1"], ["zero.stage=2"], ["zero.stage=3"],
         ["zero.stage=2", "zero.offload_optimizer=cpu"], ["zero.stage=3", "zero.offload_optimizer=cpu"],
         ["zero.stage=2", "zero.offload_optimizer=cpu", "zero.offload_ratio=0.5"],
         # ZeRO-Infinity (SWAP: a temporary folder): parameters from pinned CPU memory or a swap file, the optimizer
         # in swap files, and over three tiers (device, CPU memory, swap file)
         ["zero.stage=3", "zero.offload_param=cpu"], ["zero.stage=3", "zero.offload_param=nvme", "SWAP"],
         ["zero.stage=3", "zero.offload_optimizer=nvme", "SWAP"],
         ["zero.stage=3", "zero.offload_param=cpu", "zero.offload_optimizer=nvme", "zero.offload_ratio=0.7",
          "zero.nvme_ratio=0.5", "SWAP"]]


def assert_matches(engine, losses, stage0):
    want_params, want_losses = stage0
    assert losses == pytest.approx(want_losses, rel=1e-5)
    got = parameters(engine)
    for name, want in want_params.items():
        torch.testing.assert_close(got[name].float().cpu(), want.float().cpu(), rtol=0, atol=2e-5, msg=name)


@pytest.mark.parametrize("overrides", CASES, ids=" ".join)
def test_stage_on_cuda_matches_stage0(overrides, stage0, monkeypatch, tmp_path):
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 4096)  # many pieces through the pinned staging
    engine, losses = train([f"zero.nvme_path={tmp_path}" if o == "SWAP" else o for o in overrides])
    assert engine.device.type == "cuda"
    assert_matches(engine, losses, stage0)
    if "zero.nvme_ratio=0.5" in overrides:
        assert [p.tier for p in engine.strategy.parts] == ["none", "cpu", "nvme"]
    if getattr(engine.strategy, "swap_dir", None) is not None:
        engine.strategy.swap_dir.remove()


def test_stages_through_nccl_world_1_match_stage0(stage0, monkeypatch):
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        for overrides in (["zero.stage=0", "optimizer.implementation=torch_fused"], *CASES[:3], CASES[4]):
            engine, losses = train(overrides)
            assert engine.dist.backend == "nccl"
            assert_matches(engine, losses, stage0)
    finally:
        dist.destroy_process_group()
