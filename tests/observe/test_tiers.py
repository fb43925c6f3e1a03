"""ZeRO-Infinity's tier estimate (toolkit/observe/tiers.py) against the engine: for every offload
combination at stage 3 (and the optimizer's three at stage 2), the GPU, CPU and NVMe bytes a rank
holds and the swap bytes one step reads and writes, counted from live tensors and swap files."""
import pytest

from toolkit.observe.tiers import TIERS, estimate_tiers, tier_rows


def _engine_tiers(overrides):
    """(num_params, counted TierBytes-like dict, root chunk bytes) after one step of a 1-rank fp32 engine."""
    from tests.runtime.zero_helpers import tiny_engine

    _, engine, stream = tiny_engine(1, overrides)
    strategy = engine.strategy
    files = strategy.swap_dir.files if strategy.swap_dir is not None else []
    before = [(f.bytes_read, f.bytes_written) for f in files]
    engine.train_batch(stream.next_step())
    mem = strategy.memory_bytes()
    buffers = sum(slot.numel() * slot.element_size() for part in strategy.parts if part.swap is not None
                  for slot in part.offloaded_step.slots)
    counted = {"gpu": mem["mem_params_bytes"] + mem["mem_grads_bytes"] + mem["mem_optim_bytes"]
               + mem["mem_master_bytes"],
               "cpu": mem["mem_offload_bytes"] + buffers,
               "nvme": sum(f.nbytes for f in files),
               "read": sum(f.bytes_read - b[0] for f, b in zip(files, before)),
               "written": sum(f.bytes_written - b[1] for f, b in zip(files, before))}
    root = (strategy.weights.read(strategy.root).element_size() * strategy.groups[strategy.root].chunk
            if strategy.stage == 3 else 0)
    if strategy.swap_dir is not None:
        strategy.swap_dir.remove()
    return engine.num_parameters, counted, root


@pytest.mark.parametrize("stage", [2, 3])
def test_tier_bytes_equal_what_the_engine_holds_for_every_offload_combination(stage, tmp_path, monkeypatch):
    import toolkit.runtime.zero.offload as offload
    import toolkit.observe.tiers as tiers

    # NOTE: a piece smaller than the shard, so the nvme step's three buffer slots are counted at their bound
    monkeypatch.setattr(offload, "PIECE_NUMEL", 1 << 12)
    monkeypatch.setattr(tiers, "PIECE_NUMEL", 1 << 12)
    for param in (TIERS if stage == 3 else ("none",)):
        for optimizer in TIERS:
            overrides = [f"zero.stage={stage}", f"zero.offload_optimizer={optimizer}",
                         f"zero.offload_param={param}", f"zero.nvme_path={tmp_path}"]
            n, counted, root = _engine_tiers(overrides)
            want = estimate_tiers(n, stage=stage, world_size=1, dtype="fp32", offload_optimizer=optimizer,
                                  offload_param=param)
            got = {k: getattr(want, k) for k in counted}
            # NOTE: the root unit (embeddings, final norm) is gathered once for forward and backward together,
            # so a step reads its chunk once, not twice: the estimate is the bound, short of it by the root
            assert counted == {**got, "read": got["read"] - (root if param == "nvme" else 0)}, (optimizer, param)


@pytest.mark.parametrize("precision, state_dtype", [("bf16", "fp32"), ("bf16", "bf16"), ("bf16", "int8"),
                                                    ("fp32", "int8")])
def test_tier_bytes_with_each_state_dtype_equal_what_the_engine_holds(precision, state_dtype, tmp_path, monkeypatch):
    """Stage 3, 60% of the optimizer offloaded (so a device part too), every offload_param tier: under offload_param
    the device part keeps a separate master, and in CPU memory the host's weights are the master when the dtypes
    agree (bf16 states under bf16, fp32 under fp32: shard_part.host_shard_as_master), counted once."""
    import toolkit.runtime.zero.offload as offload
    import toolkit.observe.tiers as tiers

    monkeypatch.setattr(offload, "PIECE_NUMEL", 1 << 12)
    monkeypatch.setattr(tiers, "PIECE_NUMEL", 1 << 12)
    for param in TIERS:
        for optimizer in ("cpu", "nvme"):
            overrides = ["zero.stage=3", f"zero.offload_optimizer={optimizer}", "zero.offload_ratio=0.6",
                         f"zero.offload_param={param}", f"zero.nvme_path={tmp_path}", f"precision.dtype={precision}",
                         f"optimizer.state_dtype={state_dtype}"]
            _, engine, _ = tiny_engine_for(overrides)
            shard = engine.strategy.layout.numel
            off = sum(p.layout.numel for p in engine.strategy.parts if p.offloaded)
            n, counted, root = _engine_tiers(overrides)
            want = estimate_tiers(n, stage=3, world_size=1, dtype=precision, offload_optimizer=optimizer,
                                  offload_param=param, offload_ratio=off / shard, state_dtype=state_dtype)
            got = {k: getattr(want, k) for k in counted}
            assert counted == {**got, "read": got["read"] - (root if param == "nvme" else 0)}, (optimizer, param)


def tiny_engine_for(overrides):
    from tests.runtime.zero_helpers import tiny_engine

    recipe, engine, stream = tiny_engine(1, overrides)
    if engine.strategy.swap_dir is not None:
        engine.strategy.swap_dir.remove()
    return recipe, engine, stream


def test_three_tier_optimizer_bytes_equal_what_the_engine_holds(tmp_path, monkeypatch):
    """offload_optimizer nvme with nvme_ratio below 1: the estimate at the engine's whole-group split."""
    import toolkit.runtime.zero.offload as offload
    import toolkit.observe.tiers as tiers
    from tests.runtime.zero_helpers import tiny_engine

    monkeypatch.setattr(offload, "PIECE_NUMEL", 1 << 12)
    monkeypatch.setattr(tiers, "PIECE_NUMEL", 1 << 12)
    overrides = ["zero.stage=3", "zero.offload_optimizer=nvme", "zero.offload_ratio=0.7", "zero.nvme_ratio=0.5",
                 f"zero.nvme_path={tmp_path}"]
    _, engine, _ = tiny_engine(1, overrides)
    parts = engine.strategy.parts
    shard, off, swapped = (engine.strategy.layout.numel, sum(p.layout.numel for p in parts if p.offloaded),
                           sum(p.layout.numel for p in parts if p.swap is not None))
    engine.strategy.swap_dir.remove()
    assert 0 < swapped < off < shard  # three tiers
    n, counted, _ = _engine_tiers(overrides)
    want = estimate_tiers(n, stage=3, world_size=1, dtype="fp32", offload_optimizer="nvme",
                          offload_ratio=off / shard, nvme_ratio=swapped / off)
    assert counted == {k: getattr(want, k) for k in counted}


def test_tiers_piece_is_the_runtime_piece():
    from toolkit.observe.tiers import PIECE_NUMEL
    from toolkit.runtime.zero.offload import PIECE_NUMEL as runtime

    assert PIECE_NUMEL == runtime


def test_tier_rows_cover_every_combination_the_stage_allows():
    assert [(r.offload_optimizer, r.offload_param) for r in tier_rows(100, stage=3, world_size=1, dtype="bf16")] == [
        (o, p) for p in TIERS for o in TIERS]
    assert len(tier_rows(100, stage=1, world_size=1, dtype="bf16")) == 3
    assert len(tier_rows(100, stage=0, world_size=1, dtype="bf16")) == 1
    with pytest.raises(ValueError):
        estimate_tiers(100, stage=2, world_size=1, dtype="bf16", offload_param="cpu")
    # 8B parameters, bf16, one rank, both tiers on NVMe: 2 B of parameters + 12 B of states per parameter on
    # disk, the GPU keeps the 4-byte gradient shard only, the CPU the step's three buffer slots
    big = estimate_tiers(8 * 10**9, stage=3, world_size=1, dtype="bf16", offload_optimizer="nvme",
                         offload_param="nvme", grad_accum_steps=2)
    assert (big.gpu, big.nvme, big.cpu) == (4 * 8 * 10**9, 14 * 8 * 10**9, 36 << 24)
    assert (big.read, big.written) == (12 * 8 * 10**9 + 2 * 2 * 2 * 8 * 10**9, 14 * 8 * 10**9)


def test_cli_estimate_prints_the_tier_table_and_marks_the_recipe_row(capsys):
    from toolkit.cli.main import main

    assert main(["estimate", "quickstart", "zero.stage=3", "zero.offload_param=cpu", "zero.offload_optimizer=nvme",
                 "zero.nvme_path=/tmp"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("where the model states live at stage 3"))
    rows = lines[start + 2:start + 11]
    assert [row.split()[:2] for row in rows] == [[o, p] for p in TIERS for o in TIERS]
    assert [row for row in rows if row.endswith("<- recipe")] == [rows[5]]  # nvme optimizer, cpu params
