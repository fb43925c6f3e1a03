"""Fused kernels on a GPU, each against a float64 torch reference on fresh random inputs of
many shapes (tiny, odd, not a multiple of the vector width, misaligned, large) in fp32,
bf16 and fp16. Outputs are poisoned (the allocator's blocks filled with NaN) before each
run, and every output must be finite: an element the kernel never wrote cannot pass.
Bars: relative error ||out - ref|| / ||ref|| < 1e-5 in fp32, < 1e-2 in bf16 / fp16."""
import functools
import math

import pytest
import torch
import torch.nn.functional as F

from toolkit.ops import custom_ops, loader, norm_ops
from toolkit.ops.fused_adamw import FusedAdamW, adamw_step, global_grad_norm
from toolkit.ops.op_dispatch import DTYPE_CODES

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@functools.lru_cache(maxsize=None)
def statuses() -> dict:
    return {s.name: s for s in loader.build_all()}


def require(name: str) -> None:
    """Skip this test (not the others) when its kernel did not build; the test below reports why."""
    if not statuses()[name].active:
        pytest.skip(f"{name} did not build: {statuses()[name].reason}")


def test_every_kernel_builds_and_loads():
    missing = [s.describe() for s in statuses().values() if not s.active]
    assert not missing, "\n".join(missing)


def poison(*like: tuple) -> None:
    """Fill the caching allocator's free blocks of these (shape, dtype) sizes with NaN (0xFF bytes)."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in like for _ in range(3)]
    del blocks


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor); floor is the size of terms that cancel in ref, where they do."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    assert out64.shape == ref64.shape
    assert torch.isfinite(out64).all(), "an output element is NaN/inf (unwritten or wrong)"
    error, denominator = float((out64 - ref64).norm()), max(float(ref64.norm()), floor)
    return error / denominator if denominator > 0 else error


def randn(shape, dtype, misaligned=False):
    """Random values; misaligned=True returns a contiguous view starting one element into its storage."""
    if not misaligned:
        return torch.randn(shape, device="cuda").to(dtype)
    flat = torch.randn(math.prod(shape) + 1, device="cuda").to(dtype)
    return flat[1:].view(shape)


# ---------------------------------------------------------------------------
# LayerNorm / RMSNorm

NORM_SHAPES = [(1, 1), (3, 7), (5, 768), (17, 1000), (9, 1001), (64, 1600), (2, 3, 2048), (4099, 1024),
               (8, 8192), (33, 771), (2500, 1600)]


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_norm_forward_and_backward_match_float64(shape, dtype, rms):
    require("layernorm")
    misaligned = shape[-1] % 2 == 1
    x = randn(shape, dtype, misaligned).requires_grad_()
    cols = shape[-1]
    w = (torch.randn(cols, device="cuda") * 0.5 + 1).requires_grad_()
    b = None if rms else torch.randn(cols, device="cuda").requires_grad_()
    dy = randn(shape, dtype)
    poison((shape, dtype), ((math.prod(shape) // cols,), torch.float32))
    y = custom_ops.rms_norm(x, w, 1e-6) if rms else custom_ops.layer_norm(x, w, b, 1e-5)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if rms else b.detach().double().requires_grad_()
    y64 = custom_ops.rms_norm(x64, w64, 1e-6) if rms else custom_ops.layer_norm(x64, w64, b64, 1e-5)
    y64.backward(dy.double())
    tol = TOL[dtype]
    assert y.dtype == dtype and rel_err(y, y64) < tol
    # NOTE: dx = rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w*xhat)) cancels to ~0 when a row has one
    # element (RMSNorm: xhat = +-1); judge it against the size of the terms that cancel.
    _, _, rstd = norm_ops._norm_fwd_reference(x64.detach(), w64.detach(), None if rms else b64.detach(), 1e-6 if rms
                                               else 1e-5, rms, torch.float64)
    terms = float((rstd.unsqueeze(-1) * dy.double().reshape(-1, cols) * w64.detach()).norm())
    assert rel_err(x.grad, x64.grad, floor=terms) < tol
    # dw / db sum fp32 values over rows: fp32 precision even for 16-bit inputs (judged on the same inputs)
    assert rel_err(w.grad, w64.grad) < max(tol, 1e-5)
    if not rms:
        assert rel_err(b.grad, b64.grad) < max(tol, 1e-5)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_norm_writes_the_autocast_dtype_directly(out_dtype):
    require("layernorm")
    x, w, b = randn((300, 768), torch.float32), torch.randn(768, device="cuda"), torch.randn(768, device="cuda")
    y = custom_ops.layer_norm(x, w, b, 1e-5, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    assert rel_err(y, F.layer_norm(x.double(), (768,), w.double(), b.double(), 1e-5)) < 1e-2
    assert torch.equal(y, custom_ops.layer_norm(x, w, b, 1e-5).to(out_dtype))  # one rounding, as autocast's cast


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 7), (9, 1001), (64, 1600), (4099, 768), (8, 8192), (2500, 2048)], ids=str)
def test_the_norm_backward_with_a_residual_gradient_is_the_backward_then_the_add_bit_for_bit(shape, dtype, rms):
    """norm_bwd given the residual sum's other gradient is the plain backward's dx plus it (autograd's sum), bit for
    bit, with aligned and misaligned gradients (a misaligned one must not change the row sums' order); dw and db
    unchanged. So a fused block trains as the unfused one."""
    require("layernorm")
    module = loader.loaded_extension("norm")
    cols = shape[-1]
    w, b = torch.randn(cols, device="cuda"), None if rms else torch.randn(cols, device="cuda")
    eps = 1e-6 if rms else 1e-5
    x = randn(shape, dtype)
    _, mean, rstd = module.norm_fwd(x, w, b, eps, rms, -1)
    for misaligned in (False, True):
        dy, ds = randn(shape, dtype), randn(shape, dtype, misaligned)
        poison((shape, dtype))
        dx, dw, db = module.norm_bwd(dy, x, w, mean, rstd, rms, ds)
        dx0, dw0, db0 = module.norm_bwd(dy, x, w, mean, rstd, rms)
        assert torch.equal(dx, dx0 + ds) and torch.equal(dw, dw0) and torch.equal(db, db0)
    # through norm_ops, as a block calls it (the eager autograd function), and with a 16-bit output over an fp32
    # stream (stage 0 under autocast, where dy is 16-bit and the backward adds in torch)
    for out_dtype in {dtype, torch.bfloat16}:
        xs, rs = randn(shape, dtype).requires_grad_(), randn(shape, dtype).requires_grad_()
        s, y = (norm_ops.add_rms_norm(xs, rs, w, eps, out_dtype) if rms
                else norm_ops.add_layer_norm(xs, rs, w, b, eps, out_dtype))
        want_s = (xs + rs).detach()
        assert torch.equal(s, want_s) and torch.equal(y, module.norm_fwd(want_s, w, b, eps, rms,
                                                                         DTYPE_CODES[out_dtype])[0])
        gy, gs = randn(shape, out_dtype), randn(shape, dtype)
        torch.autograd.backward([y, s], [gy, gs])
        _, mean, rstd = module.norm_fwd(want_s, w, b, eps, rms, DTYPE_CODES[out_dtype])
        want = module.norm_bwd(gy, want_s, w, mean, rstd, rms)[0] + gs
        assert torch.equal(xs.grad, want) and torch.equal(rs.grad, want)


def test_a_gpt2_block_with_the_fused_residual_trains_as_the_unfused_one():
    """The engine's GPT-2 under bf16 autocast at stage 1 (16-bit residual stream): the blocks' fused forward against
    the same model with it off (add, then the fused norm), logits and every gradient bit for bit."""
    require("layernorm")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from toolkit.ops.fused_modules import swap_fused_modules
    from tests.ops.tiny_models import tiny_gpt2

    model = tiny_gpt2().cuda().to(torch.bfloat16).train()
    assert swap_fused_modules(model, {"layernorm": True, "bias_gelu": True})["residual_norm"] == 2
    ids = torch.randint(0, 97, (4, 32), device="cuda")
    results = []
    for fused in (False, True):
        for module in model.modules():
            if type(module).__name__ == "FusedGPT2Block":
                module.fused = fused
        model.zero_grad()
        # the math attention: a deterministic backward, so any difference is the fusion's
        with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH):
            logits = model(input_ids=ids, use_cache=False).logits
        logits.float().square().mean().backward()
        results.append((logits, [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


# ---------------------------------------------------------------------------
# bias + GELU

GELU_SHAPES = [(1, 1), (3, 7), (16, 3072), (37, 1000), (129, 3073), (5, 9, 256), (2048, 6400)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GELU_SHAPES, ids=str)
def test_bias_gelu_forward_and_backward_match_float64(shape, dtype):
    require("bias_gelu")
    cols = shape[-1]
    h = randn(shape, dtype, misaligned=cols % 2 == 1).requires_grad_()
    bias = torch.randn(cols, device="cuda").requires_grad_()
    dy = randn(shape, dtype)
    poison((shape, dtype))
    y = custom_ops.bias_gelu(h, bias)
    y.backward(dy)
    h64, b64 = h.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    u = h64 + b64
    y64 = 0.5 * u * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u.pow(3))))  # HF gelu_new
    y64.backward(dy.double())
    tol = TOL[dtype]
    assert y.dtype == dtype and rel_err(y, y64) < tol
    assert rel_err(h.grad, h64.grad) < tol
    assert rel_err(bias.grad, b64.grad) < max(tol, 1e-5)


# ---------------------------------------------------------------------------
# Cross-entropy

CE_SHAPES = [(1, 2), (3, 7), (16, 50257), (64, 50304), (7, 1000), (5, 129), (2048, 50257)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CE_SHAPES, ids=str)
def test_cross_entropy_forward_and_backward_match_float64(shape, dtype):
    require("cross_entropy")
    rows, vocab = shape
    logits = (randn(shape, dtype, misaligned=rows % 2 == 1).float() * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    if rows > 2:
        targets[1::3] = -100
    poison((shape, dtype), ((rows,), torch.float32))
    loss = custom_ops.cross_entropy(logits, targets)
    loss.backward()
    l64 = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(l64, targets)
    ref.backward()
    assert loss.dtype == torch.float32
    # fp32 maths on the same inputs: 1e-5 of the loss, plus the fp32 rounding of log-sum-exp minus the
    # target logit (terms of size max|logit|), which cancel when a row's loss is near zero
    bound = 1e-5 * abs(ref.item()) + 2 ** -22 * float(l64.detach().abs().max())
    assert abs(loss.item() - ref.item()) <= bound
    # The target's gradient is p - 1 over n rows: terms of size 1 / n that cancel when p is near 1 (a
    # tiny vocabulary), in any fp32 softmax; the floor is their norm, 1 / sqrt(n) (it failed once at (1, 2):
    # p = 0.99927, relative error 7.6e-5 of a gradient of norm 1e-3, 8e-8 of the floor).
    floor = 1 / math.sqrt(max(int((targets != -100).sum()), 1))
    assert logits.grad.dtype == dtype and rel_err(logits.grad, l64.grad, floor) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16, 50304, 50257), (2048, 50304, 50257), (5, 136, 129), (3, 16, 9)], ids=str)
def test_cross_entropy_over_a_padded_head_skips_the_extra_columns(shape, dtype):
    require("cross_entropy")
    rows, width, classes = shape
    logits = (randn((rows, width), dtype).float() * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, classes, (rows,), device="cuda")
    targets[1::3] = -100
    poison(((rows, width), dtype), ((rows,), torch.float32))
    loss = custom_ops.cross_entropy(logits, targets, classes=classes)
    loss.backward()
    l64 = logits.detach()[:, :classes].double().requires_grad_()
    ref = F.cross_entropy(l64, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()) + 2 ** -22 * float(l64.detach().abs().max())
    floor = 1 / math.sqrt(max(int((targets != -100).sum()), 1))
    assert rel_err(logits.grad[:, :classes], l64.grad, floor) < TOL[dtype]
    assert torch.count_nonzero(logits.grad[:, classes:]) == 0  # written (poisoned memory would be NaN)


def test_cross_entropy_all_rows_ignored_gives_zero_loss_and_gradient():
    require("cross_entropy")
    logits = randn((4, 33), torch.bfloat16).requires_grad_()
    loss = custom_ops.cross_entropy(logits, torch.full((4,), -100, device="cuda"))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


# ---------------------------------------------------------------------------
# AdamW

ADAMW_SIZES = [[1], [3, 4097], [4096, 4096 * 3], [5, 65537, 1_000_003], [38_597_376, 768, 2_359_296, 768]]
SETTINGS = dict(lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def adamw_float64(p, g, m, v, step, grad_scale):
    """torch.optim.AdamW's maths in float64."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = g * grad_scale
    lr, b1, b2, eps, wd = (SETTINGS[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2 ** step) + eps
    return p - lr / (1 - b1 ** step) * m / denom, m, v


@pytest.mark.parametrize("lowp_dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", ADAMW_SIZES, ids=lambda s: f"{len(s)}x{max(s)}")
def test_adamw_step_matches_float64(sizes, grad_dtype, lowp_dtype):
    require("adamw")
    misaligned = len(sizes) == 2  # odd offsets: the element-wise path
    params = [randn((n,), torch.float32, misaligned) for n in sizes]
    grads = [randn((n,), grad_dtype, misaligned) for n in sizes]
    exp_avgs = [randn((n,), torch.float32, misaligned) * 0.1 for n in sizes]
    exp_avg_sqs = [randn((n,), torch.float32, misaligned).abs() * 0.01 for n in sizes]
    lowp = [torch.full((n,), float("nan"), dtype=lowp_dtype, device="cuda") for n in sizes] if lowp_dtype else None
    before = [t.clone() for t in params]
    # |beta1 m| + |(1 - beta1) g|: m's new value can cancel to far below its terms (one element of
    # random signs), where fp32 rounding of the terms, not the kernel, sets the error
    m_terms = [(SETTINGS["beta1"] * m.double().abs() + (1 - SETTINGS["beta1"]) * 0.25 * g.double().abs()).norm()
               for m, g in zip(exp_avgs, grads)]
    expected = [adamw_float64(p, g, m, v, step=7, grad_scale=0.25)
                for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs)]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    adamw_step(params, grads, exp_avgs, exp_avg_sqs, step=7, grad_scale=0.25, lowp=lowp, nonfinite=flag, **SETTINGS)
    assert flag.item() == 0
    for i, (p_ref, m_ref, v_ref) in enumerate(expected):
        # the update itself, to 1e-5 of its size, plus the one rounding of the stored fp32 parameter
        # (2^-24 of it), which a few-element update cannot average away. Not the parameter's own
        # relative error: decay and update can cancel it to near zero (a 1-element run once ended at
        # 2e-4 with 1.4e-4 relative error, all of it the fp32 rounding of terms near 1)
        update_err = (params[i].double() - p_ref).norm()
        assert update_err <= 1e-5 * (p_ref - before[i].double()).norm() + 2 ** -24 * p_ref.norm()
        assert (exp_avgs[i].double() - m_ref).norm() < 1e-5 * m_terms[i]
        assert rel_err(exp_avg_sqs[i], v_ref) < 1e-5  # a sum of non-negative terms: no cancellation
        if lowp:
            assert torch.equal(lowp[i], params[i].to(lowp_dtype))


def test_adamw_nonfinite_gradients_are_flagged_and_left_unchanged():
    require("adamw")
    n = 3 * 4096 + 5
    p, g = randn((n,), torch.float32), randn((n,), torch.float32)
    g[10], g[5000], g[n - 1] = float("inf"), float("nan"), float("-inf")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    before, flag = p.clone(), torch.zeros(1, dtype=torch.int32, device="cuda")
    adamw_step([p], [g], [m], [v], step=1, nonfinite=flag, **SETTINGS)
    assert flag.item() == 1
    bad = torch.zeros(n, dtype=torch.bool, device="cuda")
    bad[[10, 5000, n - 1]] = True
    assert torch.equal(p[bad], before[bad]) and torch.count_nonzero(m[bad]) == 0
    assert torch.all(p[~bad] != before[~bad])


def test_adamw_skip_flag_leaves_everything_unchanged():
    require("adamw")
    p = randn((70_000,), torch.float32)
    before = p.clone()
    adamw_step([p], [randn((70_000,), torch.float32)], [torch.zeros_like(p)], [torch.zeros_like(p)], step=1,
               skip=torch.ones(1, dtype=torch.int32, device="cuda"), **SETTINGS)
    assert torch.equal(p, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_global_grad_norm_matches_float64_and_flags_overflow(dtype):
    require("adamw")
    grads = [randn((n,), dtype) for n in (1, 4097, 1_000_003, 77)]
    out = global_grad_norm(grads, grad_scale=0.5, max_norm=1.0)
    ref = math.sqrt(sum(float((g.double() * 0.5).pow(2).sum()) for g in grads))
    assert abs(out[0].item() - ref) / ref < 1e-5
    assert abs(out[1].item() - 0.5 / (ref + 1e-6)) / (0.5 / ref) < 1e-5
    grads[2][123] = float("nan")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    global_grad_norm(grads, nonfinite=flag)
    assert flag.item() == 1


def test_fused_adamw_tracks_torch_fused_adamw_on_gpt2():
    require("adamw")
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.runtime.optim import param_groups

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4, bos_token_id=None,
                        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # same grads in both
    a = GPT2LMHeadModel(config).cuda()
    b = GPT2LMHeadModel(config).cuda()
    b.load_state_dict(a.state_dict())
    settings = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(param_groups(a, 0.1), fused=True, **settings)
    fused_opt = FusedAdamW(param_groups(b, 0.1), **settings)
    for _ in range(5):
        # NOTE: one backward, its gradients given to both: SDPA's backward is not bitwise deterministic,
        # and Adam turns tiny gradient differences into lr-sized ones where gradients are near zero.
        ids = torch.randint(0, 512, (4, 64), device="cuda")
        torch_opt.zero_grad()
        fused_opt.zero_grad()
        a(input_ids=ids, labels=ids).loss.backward()
        for pa, pb in zip(a.parameters(), b.parameters()):
            pb.grad = pa.grad.clone()
        torch_opt.step()
        fused_opt.step()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert rel_err(pb, pa) < 1e-5, name


# ---------------------------------------------------------------------------
# The engine with fused kernels (and torch.compile)

def run_engine(overrides, steps=12):
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import load_recipe

    engine = Engine(load_recipe("quickstart", ["training.max_steps=50", "training.device=cuda", *overrides]))
    # NOTE: one batch, seen every step: uniform random tokens start at their floor (ln 256), a memorised
    # batch gives a loss that must fall.
    batch = torch.randint(0, 256, (16, 65), generator=torch.Generator().manual_seed(0))
    losses = [engine.train_batch([batch]).loss for _ in range(steps)]
    return engine, losses


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_engine_with_fused_kernels_trains_like_torch(dtype):
    require("adamw")
    fused, fused_losses = run_engine([f"precision.dtype={dtype}"])
    assert all(fused.kernels.active(n) for n in ("adamw", "layernorm", "bias_gelu", "cross_entropy"))
    assert type(fused.optimizer).__name__ == "FusedAdamW"
    _, torch_losses = run_engine([f"precision.dtype={dtype}"] + [f"kernels.{k}=off" for k in loader.KERNELS])
    assert fused_losses[-1] < fused_losses[0]
    for a, b in zip(fused_losses, torch_losses):
        assert abs(a - b) < 0.02 * abs(b), (fused_losses, torch_losses)


def test_engine_compiles_through_fused_kernels_without_graph_breaks():
    require("layernorm")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine, losses = run_engine(["precision.dtype=bf16", "training.compile=true"], steps=6)
    assert engine.kernels.active("layernorm")
    breaks = dict(counters["graph_break"])
    print("graph breaks:", breaks or "none")
    assert not [reason for reason in breaks if "toolkit" in reason or "custom" in reason.lower()], breaks
    _, eager_losses = run_engine(["precision.dtype=bf16"], steps=6)
    for a, b in zip(losses, eager_losses):
        assert abs(a - b) < 0.02 * abs(b), (losses, eager_losses)
