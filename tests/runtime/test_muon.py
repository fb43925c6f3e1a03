"""Muon (optimizer.type muon) in one process: which parameters it orthogonalizes on gpt2 and llama, the
whole-tensor optimizer against torch.optim.Muon + torch.optim.AdamW, the shard maths against torch's, ZeRO 1-3
against stage 0, the schedule's two lrs, checkpoint resume, and the refusals.

Tolerance: exact (torch.equal) wherever both sides run the same ops on the same gradients: the whole-tensor
optimizer is torch's own Muon and AdamW, and the shard step transcribes torch's ops in torch's order. With
gradient clipping the ZeRO global norm is summed in another order than torch's clip_grad_norm_, so gradients
differ in the last bit; torch's bf16 Newton-Schulz turns that into ~1e-3 (docs/zero-and-offload.md), which is
why those comparisons run with muon_ns_dtype fp32 at the shared 1e-5 (tests/runtime/zero_helpers.py).
"""
import copy

import pytest
import torch

from tests.runtime.zero_helpers import (SMALL_BUCKETS, assert_offload_param_changes_nothing, assert_params_close,
                                        assert_swap_files_change_nothing, save_and_resume, tiny_engine, train)

MUON = ["optimizer.type=muon", "optimizer.muon_lr=0.02", "optimizer.muon_weight_decay=0.1"]


def _model_and_spec(family: str = "gpt2", overrides=()):
    recipe, engine, _ = tiny_engine(1, [f"model.family={family}", *MUON, *overrides])
    return engine.model, recipe.optimizer


# ---------------------------------------------------------------------------
# The routing rule


def _muon_names(model) -> set[str]:
    from toolkit.runtime.muon import muon_param_ids

    ids = muon_param_ids(model)
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_gpt2_muon_takes_the_block_matrices_and_adamw_the_embeddings_head_norms_and_biases():
    model, _ = _model_and_spec("gpt2")
    want = {f"transformer.h.{i}.{m}.weight" for i in range(2)
            for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert _muon_names(model) == want
    # the tied head is the token embedding: AdamW's, as is the position embedding
    assert model.get_output_embeddings().weight is model.transformer.wte.weight


def test_llama_muon_takes_the_projections_not_embed_tokens_lm_head_or_norms():
    model, _ = _model_and_spec("llama")
    names = _muon_names(model)
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert names == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in projections}
    # the tiny llama's head is untied: its own matrix, still AdamW's
    matrices = {n for n, p in model.named_parameters() if p.ndim == 2}
    assert not model.config.tie_word_embeddings
    assert matrices - names == {"model.embed_tokens.weight", "lm_head.weight"}


# ---------------------------------------------------------------------------
# Against torch


def _random_grads(params, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=generator) * 0.01 for p in params]


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_whole_tensor_muon_equals_torch_muon_plus_torch_adamw_bit_for_bit(adjust):
    from toolkit.runtime.optim import build_optimizer, optimizer_param_groups

    model, spec = _model_and_spec("gpt2", [f"optimizer.muon_adjust_lr={adjust}", "optimizer.muon_nesterov=false"])
    reference = copy.deepcopy(model)
    ours = build_optimizer(spec, optimizer_param_groups(model, spec), "torch")
    groups = optimizer_param_groups(reference, spec)
    torch_muon = torch.optim.Muon(groups[0]["params"], lr=spec.muon_lr, weight_decay=spec.muon_weight_decay,
                                  momentum=spec.muon_momentum, nesterov=False, ns_steps=spec.muon_ns_steps,
                                  adjust_lr_fn=adjust)
    torch_adamw = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups[1:]],
                                    lr=spec.lr, betas=spec.betas, eps=spec.eps)
    for step in range(5):
        for params in (list(model.parameters()), list(reference.parameters())):
            for p, g in zip(params, _random_grads(params, step)):
                p.grad = g
        ours.step()
        torch_muon.step()
        torch_adamw.step()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_shard_maths_equals_torch_muon_on_tall_and_wide_matrices(shape, nesterov):
    from toolkit.runtime.muon import muon_step

    generator = torch.Generator().manual_seed(0)
    ours, theirs = torch.randn(shape, generator=generator), None
    theirs = torch.nn.Parameter(ours.clone())
    torch_muon = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    group = {**torch_muon.param_groups[0], "ns_dtype": "bf16"}
    buf = torch.zeros(shape)
    for _ in range(4):
        grad = torch.randn(shape, generator=generator)
        theirs.grad = grad.clone()
        torch_muon.step()
        # the shard passes flat slices: the maths takes any layout of the same elements
        muon_step(ours.view(-1), grad.view(-1), buf.view(-1), group, shape)
    assert torch.equal(ours, theirs.detach())


def test_zero_1_to_3_in_one_process_match_stage_0_bit_for_bit():
    overrides = [*MUON, "training.grad_clip=0"]
    reference, _, losses, _ = train(1, [*overrides, "zero.stage=0"], steps=4)
    for stage in (1, 2, 3):
        engine, _, got, _ = train(1, [*overrides, f"zero.stage={stage}"], steps=4)
        assert got == losses
        for name, want in reference.strategy.full_parameters().items():
            assert torch.equal(engine.strategy.full_parameters()[name], want), (stage, name)


def test_with_clipping_and_fp32_newton_schulz_zero_2_and_3_match_stage_0_within_1e_5():
    overrides = [*MUON, "optimizer.muon_ns_dtype=fp32"]
    reference, _, _, _ = train(1, [*overrides, "zero.stage=0"])
    for stage in (2, 3):
        engine, _, _, _ = train(1, [*overrides, f"zero.stage={stage}"])
        assert_params_close(engine.strategy.full_parameters(), reference.strategy.full_parameters())


# ---------------------------------------------------------------------------
# The schedule, checkpoints, refusals


@pytest.mark.parametrize("stage", [0, 2])
def test_the_schedule_scales_muon_lr_by_the_same_factor_as_lr(stage):
    _, engine, stream = tiny_engine(1, [*MUON, f"zero.stage={stage}"])  # WarmupCosineLR
    seen = []
    for _ in range(5):
        engine.train_batch(stream.next_step())
        muon, *adamw = engine.optimizer.param_groups
        assert muon["muon"] and muon["lr"] == pytest.approx(adamw[0]["lr"] * 0.02 / 0.003, rel=1e-12)
        assert engine.current_lr == adamw[0]["lr"] == engine.scheduler.current_lr  # what the log prints
        seen.append(adamw[0]["lr"])
    assert len(set(seen)) == 5 and 0 < max(seen) <= 0.003  # warming up and decaying: the factor moved


@pytest.mark.parametrize("stage", [0, 2])
def test_resume_from_a_checkpoint_is_bit_exact(stage, tmp_path):
    from toolkit.checkpoint.checkpointer import Checkpointer, restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    overrides = [*MUON, f"zero.stage={stage}"]
    recipe, engine, stream = tiny_engine(1, overrides)
    checkpointer = Checkpointer(recipe, tmp_path, engine, stream)
    straight = []
    for step in range(8):
        straight.append(engine.train_batch(stream.next_step()).loss)
        if step == 4:
            checkpointer.save()
    _, resumed, resumed_stream = tiny_engine(1, overrides)
    restore_engine_and_stream(load_checkpoint(find_checkpoint(tmp_path)), resumed, resumed_stream)
    assert [resumed.train_batch(resumed_stream.next_step()).loss for _ in range(3)] == straight[5:]
    for name, want in engine.strategy.full_parameters().items():
        assert torch.equal(resumed.strategy.full_parameters()[name], want), name


@pytest.mark.parametrize("saved, resumed", [(0, 2), (2, 0)])
def test_a_checkpoint_resumes_across_stage_0_and_2_with_every_state(saved, resumed, tmp_path):
    from toolkit.checkpoint.checkpointer import Checkpointer, restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    recipe, engine, stream = tiny_engine(1, [*MUON, f"zero.stage={saved}"])
    for _ in range(3):
        engine.train_batch(stream.next_step())
    Checkpointer(recipe, tmp_path, engine, stream).save()
    _, other, other_stream = tiny_engine(1, [*MUON, f"zero.stage={resumed}"])
    restore_engine_and_stream(load_checkpoint(find_checkpoint(tmp_path)), other, other_stream)
    before, after = ({name: views for name, _, _, views in e.strategy.owned_pieces()} for e in (engine, other))
    assert before.keys() == after.keys()
    for name in before:  # weights, momentum (exp_avg at the matrices), moments: bit for bit
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[name][kind], before[name][kind]), (name, kind)
    matrix = "transformer.h.0.attn.c_proj.weight"
    assert before[matrix]["exp_avg"].any() and not after[matrix]["exp_avg_sq"].any()
    assert other.strategy.optimizer_steps() == 3


@pytest.mark.parametrize("stage, ratio", [(1, 1), (2, 1), (3, 1), (3, 0.5)])
def test_offloaded_muon_steps_as_on_the_device_bit_for_bit_and_holds_what_the_estimate_says(stage, ratio):
    """zero.offload_optimizer cpu: momentum, AdamW's moments and the fp32 master in CPU memory, the updates
    gathered and orthogonalized on the training device (here the CPU too): the device's losses and weights. At
    offload_ratio 0.5 a device part and a CPU part share one schedule; the estimate splits Muon's saving between
    them by elements (approximate per column, exact in sum)."""
    from toolkit.observe.estimate import estimate_model_state_bytes
    from toolkit.runtime.muon import muon_param_ids

    device, _, device_losses, _ = train(1, [*MUON, f"zero.stage={stage}"])
    engine, _, losses, _ = train(1, [*MUON, f"zero.stage={stage}", "zero.offload_optimizer=cpu",
                                     f"zero.offload_ratio={ratio}"])
    assert [p.offloaded for p in engine.strategy.parts] == ([True] if ratio == 1 else [False, True])
    assert losses == device_losses
    want = device.strategy.full_parameters()
    assert all(torch.equal(got, want[name]) for name, got in engine.strategy.full_parameters().items())
    held = engine.strategy.memory_bytes()
    matrices = sum(p.numel() for p in engine.model.parameters() if id(p) in muon_param_ids(engine.model))
    estimate = estimate_model_state_bytes(engine.num_parameters, stage=stage, world_size=1, dtype="fp32",
                                          offload="cpu", muon_params=matrices,
                                          offload_ratio=engine.strategy.parts[-1].layout.numel / engine.num_parameters)
    if ratio == 1:
        assert held["mem_offload_bytes"] == estimate.cpu_optim and held["mem_optim_bytes"] == estimate.optim == 0
    else:
        assert held["mem_offload_bytes"] + held["mem_optim_bytes"] == estimate.cpu_optim + estimate.optim


def test_offloaded_muon_resumes_bit_exactly(tmp_path):
    overrides = [*MUON, "zero.stage=2", "zero.offload_optimizer=cpu"]
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / "run", overrides, overrides)
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert len(resumed) == 5 and resumed == uninterrupted


@pytest.mark.parametrize("stage, extra", [(1, []), (2, ["zero.offload_ratio=0.5"]), (3, []),
                                          (3, ["zero.offload_ratio=0.5"])])
def test_muon_in_swap_files_steps_as_in_cpu_memory_bit_for_bit(stage, extra, tmp_path, monkeypatch):
    """zero.offload_optimizer nvme: master, momentum and exp_avg_sq (the chunk layout) in a swap file, streamed a
    piece at a time (pieces of 1,000 elements here, so matrices and runs are cut): the losses and weights of
    offload_optimizer cpu; 12 bytes an element in the file, as the tiers row counts (whole shard offloaded); none of it
    in memory after."""
    monkeypatch.setattr("toolkit.runtime.zero.offload.PIECE_NUMEL", 1000)
    _, engine, tiers = assert_swap_files_change_nothing([*MUON, f"zero.stage={stage}", SMALL_BUCKETS, *extra],
                                                        tmp_path)
    swapped = [part for part in engine.strategy.parts if part.tier == "nvme"]
    assert len(swapped) == 1 and len(engine.strategy.parts) == (1 if not extra else 2)
    assert swapped[0].swap_bytes == 12 * swapped[0].layout.numel
    matrices = sum(b - a for pieces in swapped[0].optimizer.pieces for slot, a, b in pieces if slot.muon)
    assert swapped[0].swap_read_bytes == swapped[0].swap_bytes + 4 * matrices  # the matrices' master read twice
    if not extra:  # (below offload_ratio 1 the toolkit cuts at whole groups, the estimate at the ratio)
        assert swapped[0].swap_bytes == tiers.nvme and engine.strategy.memory_bytes()["mem_offload_bytes"] == 0
        assert tiers.read == swapped[0].swap_read_bytes and tiers.written == swapped[0].swap_bytes


def test_muon_in_swap_files_resumes_bit_exactly(tmp_path):
    overrides = [*MUON, "zero.stage=3", "zero.offload_optimizer=nvme", f"zero.nvme_path={tmp_path}"]
    saved, restored, uninterrupted, resumed, _ = save_and_resume(tmp_path / "run", overrides, overrides)
    assert all(torch.equal(restored[key], saved[key]) for key in saved)
    assert len(resumed) == 5 and resumed == uninterrupted


@pytest.mark.parametrize("overrides, what", [
    (["zero.stage=2", "zero.offload_optimizer=cpu", "zero.offload_update=delayed"], "offload_update 'delayed'"),
    (["zero.stage=2", "zero.offload_optimizer=nvme", "zero.nvme_path=/tmp", "zero.offload_update=delayed_extrapolated"],
     "offload_update 'delayed_extrapolated'"),
    (["parallel.tensor=2"], "parallel.tensor/pipeline > 1")])
def test_muon_with_the_delayed_update_or_a_mesh_is_refused_in_one_line(overrides, what):
    from toolkit.recipe.load import RecipeError, load_recipe

    with pytest.raises(RecipeError) as caught:
        load_recipe("quickstart", ["optimizer.type=muon", *overrides], world_size=2)
    assert len(caught.value.lines) == 1
    assert caught.value.lines[0].startswith("recipe.optimizer.type: 'muon'") and what in caught.value.lines[0]


@pytest.mark.parametrize("optimizer", ["none", "cpu"])
def test_muon_with_the_parameters_offloaded_trains_as_with_them_on_the_device(optimizer, tmp_path):
    """Stage 3 with zero.offload_param cpu and nvme, Muon's states on the device or offloaded: the same losses and
    weights bit for bit as offload_param none (offloaded under fp32, the parameter shard in CPU memory is the
    master Muon steps)."""
    engines = assert_offload_param_changes_nothing([*MUON, f"zero.offload_optimizer={optimizer}"], tmp_path)
    assert engines["cpu"].strategy.parts[-1].weights_are_master == (optimizer == "cpu")
