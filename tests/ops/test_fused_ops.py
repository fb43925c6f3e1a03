"""The fused ops without a GPU: the custom ops and swapped modules match torch (their references on the
CPU), FusedAdamW matches torch.optim.AdamW."""
import copy

import pytest
import torch
import torch.nn.functional as F

from toolkit.ops import custom_ops, loader, norm_ops
from toolkit.ops.fused_adamw import FusedAdamW, adamw_step, global_grad_norm
from toolkit.ops.fused_modules import swap_fused_modules
from toolkit.runtime.optim import param_groups
from toolkit.runtime.zero.ddp import OnePassStep
from tests.ops.tiny_models import tiny_gpt2, tiny_llama


# ---------------------------------------------------------------------------
# Fused modules and custom ops (torch references on the CPU)

def set_reference_ops(model, value=True):
    for module in model.modules():
        if hasattr(module, "reference_ops"):
            module.reference_ops = value


@pytest.mark.parametrize("build, use, expected", [
    (tiny_gpt2, {"layernorm": True, "bias_gelu": True}, {"layernorm": 5, "bias_gelu": 2, "residual_norm": 2}),
    (tiny_llama, {"rmsnorm": True}, {"rmsnorm": 5, "residual_norm": 2}),
])
def test_swapped_model_with_torch_fallbacks_gives_identical_logits(build, use, expected):
    model = build()
    ids = torch.randint(0, 97, (2, 16))
    before = model(input_ids=ids).logits
    keys, groups = list(model.state_dict()), [[id(p) for p in g["params"]] for g in param_groups(model, 0.1)]
    counts = swap_fused_modules(model, use)
    assert {k: v for k, v in counts.items() if v} == expected
    assert list(model.state_dict()) == keys
    assert [[id(p) for p in g["params"]] for g in param_groups(model, 0.1)] == groups
    assert torch.equal(model(input_ids=ids).logits, before)  # CPU input: the transformers forward, bit for bit


@pytest.mark.parametrize("build, use", [(tiny_gpt2, {"layernorm": True, "bias_gelu": True}),
                                        (tiny_llama, {"rmsnorm": True})])
def test_fused_path_matches_transformers_forward_and_backward(build, use):
    reference = build()
    fused = copy.deepcopy(reference)
    swap_fused_modules(fused, use)
    set_reference_ops(fused)
    ids = torch.randint(0, 97, (2, 16))
    out_ref, out = reference(input_ids=ids).logits, fused(input_ids=ids, use_cache=False).logits  # the blocks fuse too
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    for (name, a), b in zip(reference.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("build, use", [(tiny_gpt2, {"layernorm": True}), (tiny_llama, {"rmsnorm": True})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_add_fused_into_the_norm_changes_no_bit(build, use, dtype, monkeypatch):
    """The blocks' add + norm in one op (norm_ops.add_layer_norm / add_rms_norm) against the same model whose blocks
    add first and call the fused norm after: the sum rounds where torch's add rounds, and the backward sums the two
    gradients of the sum after dx's rounding, as autograd does, so logits and every gradient are equal bit for bit."""
    calls = []
    for name in ("add_layer_norm", "add_rms_norm"):
        op = getattr(custom_ops, name)
        monkeypatch.setattr(custom_ops, name, lambda *a, op=op, **k: calls.append(1) or op(*a, **k))
    model = build().to(dtype)
    assert swap_fused_modules(model, use)["residual_norm"] == 2
    set_reference_ops(model)
    ids = torch.randint(0, 97, (2, 16))
    results = []
    for fused_blocks in (False, True):
        for module in model.modules():
            if type(module).__name__.startswith("Fused") and type(module).__name__.endswith(("Block", "Layer")):
                module.fused = fused_blocks
        model.zero_grad()
        logits = model(input_ids=ids, use_cache=False).logits  # as the engine's configs: no cache in training
        logits.float().square().mean().backward()
        results.append((logits, [p.grad.clone() for p in model.parameters()]))
        assert len(calls) == (2 if fused_blocks else 0)  # one per block, in the fused round only
    (logits_a, grads_a), (logits_b, grads_b) = results
    assert torch.equal(logits_a, logits_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_the_fused_blocks_take_transformers_own_forward_with_a_cache(monkeypatch):
    """Generation passes a cache: the fused blocks leave the whole block to transformers (its add and norm: the
    fused op is never called) and generate what the unswapped model does."""
    monkeypatch.setattr(custom_ops, "add_layer_norm", lambda *a, **k: 1 / 0)
    reference = tiny_gpt2()
    fused = copy.deepcopy(reference)
    swap_fused_modules(fused, {"layernorm": True})
    set_reference_ops(fused)
    ids = torch.randint(0, 97, (1, 8))
    a = reference.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    b = fused.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(a, b)


def test_compile_traces_the_fused_ops_without_graph_breaks():
    model = tiny_gpt2()
    swap_fused_modules(model, {"layernorm": True, "bias_gelu": True})
    set_reference_ops(model)
    ids = torch.randint(0, 97, (2, 16))

    def loss_fn(ids):
        logits = model(input_ids=ids, use_cache=False).logits  # no cache: the blocks' fused forward is traced too
        return custom_ops.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))

    expected = loss_fn(ids)
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    loss = compiled(ids)
    loss.backward()
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("op, args", [
    ("norm_fwd", lambda: (torch.randn(3, 5, 16), torch.randn(16), torch.randn(16), 1e-5, False, -1)),
    ("norm_fwd", lambda: (torch.randn(4, 16), torch.randn(16), None, 1e-6, True, 1)),
    ("add_norm_fwd", lambda: (torch.randn(3, 5, 16), torch.randn(3, 5, 16), torch.randn(16), torch.randn(16), 1e-5,
                              False, -1)),
    ("norm_bwd", lambda: (torch.randn(4, 16), torch.randn(4, 16), torch.randn(16), torch.randn(4), torch.rand(4),
                          False, torch.randn(4, 16))),
    ("bias_gelu_fwd", lambda: (torch.randn(6, 24), torch.randn(24))),
    ("cross_entropy_fwd", lambda: (torch.randn(5, 11), torch.tensor([1, -100, 3, 10, 0]), -100, 11)),
    ("cross_entropy_fwd", lambda: (torch.randn(5, 16), torch.tensor([1, -100, 3, 10, 0]), -100, 11)),
])
def test_custom_ops_are_well_formed(op, args):
    from torch.library import opcheck

    result = opcheck(getattr(norm_ops, op, None) or getattr(custom_ops, op), args())
    assert set(result.values()) == {"SUCCESS"}, result


def test_custom_op_gradients_match_finite_differences():
    d = dict(dtype=torch.float64, requires_grad=True)
    x, w, b = torch.randn(3, 4, 9, **d), torch.randn(9, **d), torch.randn(9, **d)
    assert torch.autograd.gradcheck(lambda x, w, b: custom_ops.layer_norm(x, w, b, 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: custom_ops.rms_norm(x, w, 1e-6), (x, w))
    h, bias = torch.randn(5, 7, **d), torch.randn(7, **d)
    assert torch.autograd.gradcheck(custom_ops.bias_gelu, (h, bias))
    logits, targets = torch.randn(6, 13, **d), torch.tensor([0, 12, -100, 5, 5, 1])
    assert torch.autograd.gradcheck(lambda z: custom_ops.cross_entropy(z, targets), (logits,))
    padded = torch.randn(6, 16, **d)  # 13 classes in 16 columns: a padded LM head's logits
    assert torch.autograd.gradcheck(lambda z: custom_ops.cross_entropy(z, targets, classes=13), (padded,))


def test_cross_entropy_matches_torch_with_ignored_rows():
    logits, targets = torch.randn(37, 101), torch.randint(0, 101, (37,))
    targets[::5] = -100
    torch.testing.assert_close(custom_ops.cross_entropy(logits, targets), F.cross_entropy(logits, targets))


def test_cross_entropy_over_padded_columns_ignores_them():
    logits, targets = torch.randn(37, 128, requires_grad=True), torch.randint(0, 101, (37,))
    targets[::5] = -100
    loss = custom_ops.cross_entropy(logits, targets, classes=101)
    loss.backward()
    sliced = logits.detach()[:, :101].requires_grad_()
    expected = F.cross_entropy(sliced, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logits.grad[:, :101], sliced.grad)
    assert torch.equal(logits.grad[:, 101:], torch.zeros(37, 27))
    with pytest.raises(ValueError, match=r"classes must be in \[1, 128\], got 129"):
        custom_ops.cross_entropy(logits, targets, classes=129)


def test_ops_take_the_reference_path_for_cpu_tensors_even_when_loaded(monkeypatch):
    class Exploding:
        def __getattr__(self, name):
            raise AssertionError("a CUDA kernel was called with CPU tensors")

    monkeypatch.setitem(loader._modules, "norm", Exploding())
    x = torch.randn(4, 8)
    torch.testing.assert_close(custom_ops.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5),
                               F.layer_norm(x, (8,), eps=1e-5))


# ---------------------------------------------------------------------------
# AdamW

def two_group_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def test_fused_adamw_with_loss_scale_and_clip_matches_torch_adamw():
    torch_model, fused_model = two_group_model(), two_group_model()
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(param_groups(torch_model, 0.1), **settings)
    fused_opt = FusedAdamW(param_groups(fused_model, 0.1), **settings)
    one_pass = OnePassStep(fused_opt)  # stage 0's step over FusedAdamW (toolkit/runtime/zero/ddp.py)
    scale, clip = 1024.0, 0.5
    for _ in range(6):
        x = torch.randn(8, 7)
        for model in (torch_model, fused_model):
            (model(x).square().sum() * scale).backward()
        # torch: check, unscale, clip, step (the engine's path for torch AdamW)
        torch._foreach_mul_([p.grad for p in torch_model.parameters()], 1 / scale)
        norm_ref = float(torch.nn.utils.clip_grad_norm_(list(torch_model.parameters()), clip))
        torch_opt.step()
        torch_opt.zero_grad()
        # fused: the same calls, one read of the gradients
        assert one_pass.grads_overflow() is False
        one_pass.scale_grads(1 / scale)
        norm = one_pass.clip_grad_norm(clip)
        fused_opt.step()
        fused_opt.zero_grad(set_to_none=False)
        one_pass.reset()
        assert norm == pytest.approx(norm_ref, rel=1e-5)
    for a, b in zip(torch_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_fused_adamw_state_dict_round_trips_through_torch_adamw():
    model = two_group_model()
    fused = FusedAdamW(param_groups(model, 0.1), lr=1e-3)
    model(torch.randn(2, 7)).sum().backward()
    fused.step()
    torch_opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    torch_opt.load_state_dict(fused.state_dict())
    fused.load_state_dict(torch_opt.state_dict())
    assert {k for s in fused.state.values() for k in s} == {"step", "exp_avg", "exp_avg_sq"}


def test_adamw_step_leaves_nonfinite_elements_and_raises_the_flag():
    p, g = torch.randn(10), torch.randn(10)
    g[3], g[7] = float("inf"), float("nan")
    m, v, before = torch.zeros(10), torch.zeros(10), p.clone()
    flag, lowp = torch.zeros(1, dtype=torch.int32), torch.empty(10, dtype=torch.bfloat16)
    adamw_step([p], [g], [m], [v], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
               lowp=[lowp], nonfinite=flag)
    assert flag.item() == 1
    assert p[3] == before[3] and p[7] == before[7] and m[3] == 0 and v[7] == 0
    assert torch.all(p[[0, 1, 2, 4, 5, 6, 8, 9]] != before[[0, 1, 2, 4, 5, 6, 8, 9]])
    assert torch.equal(lowp, p.bfloat16())


def test_adamw_step_does_nothing_when_skip_is_set():
    p, before = torch.randn(5), None
    before = p.clone()
    adamw_step([p], [torch.randn(5)], [torch.zeros(5)], [torch.zeros(5)], lr=0.1, beta1=0.9, beta2=0.999,
               eps=1e-8, weight_decay=0.1, step=1, skip=torch.ones(1, dtype=torch.int32))
    assert torch.equal(p, before)


def test_global_grad_norm_unscales_clips_and_flags():
    grads = [torch.full((3,), 2.0), torch.full((4,), 2.0)]
    norm, multiplier = global_grad_norm(grads, grad_scale=0.5, max_norm=1.0).tolist()
    assert norm == pytest.approx(7 ** 0.5)
    assert multiplier == pytest.approx(0.5 / (7 ** 0.5 + 1e-6))
    flag = torch.zeros(1, dtype=torch.int32)
    global_grad_norm([torch.tensor([1.0, float("inf")])], nonfinite=flag)
    assert flag.item() == 1


