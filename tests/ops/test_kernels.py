"""Fused kernels without a GPU: a build never breaks a run (fallback, errors, status), the
architecture list parses what users set, the custom ops and swapped modules match torch,
FusedAdamW matches torch.optim.AdamW, and the CUDA sources compile for sm_90 with nvcc."""
import copy
import re
import shutil
import subprocess
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO, run_cli
from toolkit.ops import custom_ops, loader, toolchain
from toolkit.errors import UserError
from toolkit.ops.fused_adamw import FusedAdamW, OnePassStep, adamw_step, global_grad_norm
from toolkit.ops.fused_modules import swap_fused_modules
from toolkit.runtime.optim import param_groups
from toolkit.specs import KernelsSpec

ALL_AUTO = KernelsSpec(adamw="auto", layernorm="auto", rmsnorm="auto", bias_gelu="auto", cross_entropy="auto")
GPT2_NEEDS = ("layernorm", "bias_gelu", "cross_entropy", "adamw")


# ---------------------------------------------------------------------------
# Architectures and the build cache

@pytest.mark.parametrize("text, expected", [
    ("9.0a", ["9.0a"]),                       # what the H200 machines set (DeepSpeed 0.19's builder crashes on it)
    ("9.0+PTX", ["9.0"]),
    ("8.0;9.0", ["8.0", "9.0"]),
    ("8.0, 9.0", ["8.0", "9.0"]),
    ("7.5 8.6+PTX", ["7.5", "8.6"]),
    ("sm_90a;compute_80", ["9.0a", "8.0"]),
    ("90", ["9.0"]),
    ("120", ["12.0"]),
    ("10.0a", ["10.0a"]),
    ("Hopper", ["9.0"]),
    ("Ampere;Hopper", ["8.0", "8.6", "9.0"]),
    ("native", []),
    ("", []),
])
def test_arch_list_parses_what_users_set(text, expected):
    archs, bad = toolchain.parse_arch_list(text)
    assert [str(a) for a in archs] == expected
    assert bad == []


def test_arch_list_keeps_good_entries_and_names_bad_ones():
    archs, bad = toolchain.parse_arch_list("9.0;banana;;8.x")
    assert [str(a) for a in archs] == ["9.0"]
    assert bad == ["banana", "8.x"]


def test_gencode_builds_each_arch_and_ptx_of_the_highest_plain_one():
    flags = toolchain.gencode_flags([toolchain.CudaArch(8, 0), toolchain.CudaArch(9, 0, "a")])
    assert flags == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
                     "-gencode=arch=compute_80,code=compute_80"]
    assert toolchain.gencode_flags([toolchain.CudaArch(9, 0)])[-1] == "-gencode=arch=compute_90,code=compute_90"


def test_targets_are_the_gpu_present_plus_the_env_list(monkeypatch):
    monkeypatch.setattr(toolchain, "_present_archs", lambda: [toolchain.CudaArch(9, 0)])
    monkeypatch.setattr(toolchain, "_nvcc_supported_sms", lambda: frozenset({"80", "86", "90"}))
    assert [str(a) for a in toolchain.target_archs("")[0]] == ["9.0"]
    assert [str(a) for a in toolchain.target_archs("9.0a")[0]] == ["9.0a"]  # the 'a' variant replaces the plain one
    archs, notes = toolchain.target_archs("8.0;7.0;oops")
    assert [str(a) for a in archs] == ["8.0", "9.0"]
    assert any("oops" in n for n in notes) and any("7.0" in n for n in notes)
    monkeypatch.setattr(toolchain, "_present_archs", lambda: [])
    assert [str(a) for a in toolchain.target_archs("")[0]] == ["9.0"]  # nothing known: H100/H200


def test_cache_key_follows_sources_flags_and_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("TOOLKIT_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(toolchain, "_present_archs", lambda: [])
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    hopper = loader.build_plan("adamw")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    ampere = loader.build_plan("adamw")
    assert hopper.key != ampere.key and hopper.directory != ampere.directory
    assert hopper.directory.parent == tmp_path and hopper.module_name.startswith("toolkit_adamw_")
    assert loader.build_plan("norm").key != ampere.key


def test_every_header_the_kernels_include_is_in_the_cache_key():
    """A header left out of loader.HEADERS would let an edit to it reuse a stale build."""
    kernels = REPO / "kernels"
    included = set()
    for path in kernels.iterdir():
        if path.suffix in {".cu", ".cpp", ".cuh", ".h"}:
            included |= set(re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M))
    assert included and included <= set(loader.HEADERS), sorted(included - set(loader.HEADERS))


# ---------------------------------------------------------------------------
# Choosing kernels: auto falls back, on is an error, off is torch

def test_auto_on_the_cpu_falls_back_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = loader.resolve(ALL_AUTO, "cpu", GPT2_NEEDS)
    assert not any(chosen.active(n) for n in GPT2_NEEDS)
    assert "CPU" in chosen.statuses["layernorm"].reason


def test_auto_with_a_failed_build_warns_once_with_reason_and_fix(monkeypatch):
    broken = lambda name, build=False: loader.KernelStatus(name, "unavailable", "build failed: nvcc exploded",  # noqa: E731
                                                        "run `toolkit build-kernels --verbose`")
    monkeypatch.setattr(loader, "kernel_status", broken)
    with pytest.warns(loader.KernelFallbackWarning) as caught:
        chosen = loader.resolve(ALL_AUTO, "cuda", GPT2_NEEDS)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "nvcc exploded" in message and "toolkit build-kernels" in message and "layernorm" in message
    assert not chosen.active("adamw")


def test_describe_names_kernels_that_share_a_reason_together():
    spec = KernelsSpec(adamw="off", layernorm="auto", rmsnorm="auto", bias_gelu="off", cross_entropy="auto")
    text = loader.resolve(spec, "cpu", GPT2_NEEDS).describe()
    assert text.startswith("torch ") and text.count("CUDA-only") == 1 and text.count("(off)") == 1
    assert all(name in text for name in GPT2_NEEDS)


def test_on_without_the_kernel_is_an_error_naming_the_recipe_key(monkeypatch):
    spec = KernelsSpec(adamw="auto", layernorm="on", rmsnorm="auto", bias_gelu="off", cross_entropy="auto")
    with pytest.raises(UserError) as err:
        loader.resolve(spec, "cpu", GPT2_NEEDS)
    assert len(err.value.lines) == 1 and err.value.lines[0].startswith("recipe.kernels.layernorm: 'on'")


def test_off_is_torch_and_never_builds(monkeypatch):
    def explode(*args, **kwargs):
        raise AssertionError("built a kernel that is off")

    monkeypatch.setattr(loader, "kernel_status", explode)
    spec = KernelsSpec(adamw="off", layernorm="off", rmsnorm="off", bias_gelu="off", cross_entropy="off")
    chosen = loader.resolve(spec, "cuda", GPT2_NEEDS)
    assert {s.state for s in chosen.statuses.values()} == {"off"}


def test_kernel_on_in_a_cpu_run_exits_2_with_one_line(tmp_path):
    result = run_cli("run", "quickstart", "training.max_steps=30", "kernels.layernorm=on", "training.device=cpu",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: recipe.kernels.layernorm: 'on'"), result.stderr
    assert "Traceback" not in result.stderr


def test_zero_stages_1_to_3_never_resolve_the_adamw_kernel_their_step_does_not_use():
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import load_recipe

    # On the CPU `on` for a kernel the run resolves is an error (as for layernorm above): stage 0's
    # optimizer could use the AdamW kernel, so it is resolved; stages 1-3 step their shards without it
    # (toolkit/runtime/zero/adamw.py), so it is neither resolved, built nor loaded for them.
    overrides = ["training.device=cpu", "kernels.adamw=on"]
    with pytest.raises(UserError, match=r"^recipe\.kernels\.adamw: 'on'"):
        Engine(load_recipe("quickstart", [*overrides, "zero.stage=0"]))
    for stage in (1, 2, 3):
        engine = Engine(load_recipe("quickstart", [*overrides, f"zero.stage={stage}"]))
        assert "adamw" not in engine.kernels.statuses and loader.loaded_extension("adamw") is None
        assert "layernorm" in engine.kernels.statuses  # the model's kernels are still resolved


def test_auto_run_on_the_cpu_trains_exactly_like_kernels_off():
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import load_recipe

    losses = {}
    for mode in ("auto", "off"):
        overrides = ["training.max_steps=30", "training.device=cpu"] + [f"kernels.{k}={mode}" for k in loader.KERNELS]
        engine = Engine(load_recipe("quickstart", overrides))
        generator = torch.Generator().manual_seed(0)
        losses[mode] = [engine.train_batch([torch.randint(0, 256, (4, 33), generator=generator)]).loss
                        for _ in range(3)]
    assert losses["auto"] == losses["off"]


def test_doctor_lists_every_kernel_state():
    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    for name in loader.KERNELS:
        assert any(line.strip().startswith(name) for line in result.stdout.splitlines()), result.stdout


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch can build the kernels")
def test_build_kernels_without_cuda_torch_exits_2_saying_how_to_fix():
    result = run_cli("build-kernels", "adamw")
    assert result.returncode == 2
    assert "recipe" not in result.stderr and "install a CUDA build of torch" in result.stderr


# ---------------------------------------------------------------------------
# Fused modules and custom ops (torch references on the CPU)

def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config).eval()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32)).eval()


def set_reference_ops(model, value=True):
    for module in model.modules():
        if hasattr(module, "reference_ops"):
            module.reference_ops = value


@pytest.mark.parametrize("build, use, expected", [
    (tiny_gpt2, {"layernorm": True, "bias_gelu": True}, {"layernorm": 5, "bias_gelu": 2}),
    (tiny_llama, {"rmsnorm": True}, {"rmsnorm": 5}),
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
    out_ref, out = reference(input_ids=ids).logits, fused(input_ids=ids).logits
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    for (name, a), b in zip(reference.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_traces_the_fused_ops_without_graph_breaks():
    model = tiny_gpt2()
    swap_fused_modules(model, {"layernorm": True, "bias_gelu": True})
    set_reference_ops(model)
    ids = torch.randint(0, 97, (2, 16))

    def loss_fn(ids):
        logits = model(input_ids=ids).logits
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
    ("bias_gelu_fwd", lambda: (torch.randn(6, 24), torch.randn(24))),
    ("cross_entropy_fwd", lambda: (torch.randn(5, 11), torch.tensor([1, -100, 3, 10, 0]), -100, 11)),
    ("cross_entropy_fwd", lambda: (torch.randn(5, 16), torch.tensor([1, -100, 3, 10, 0]), -100, 11)),
])
def test_custom_ops_are_well_formed(op, args):
    from torch.library import opcheck

    result = opcheck(getattr(custom_ops, op), args())
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


class StageZero:
    """The stage-0 strategy surface OnePassStep wraps (toolkit/runtime/zero/ddp.py)."""
    stage = 0

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def optimizer_step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=False)


def test_fused_adamw_with_loss_scale_and_clip_matches_torch_adamw():
    torch_model, fused_model = two_group_model(), two_group_model()
    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(param_groups(torch_model, 0.1), **settings)
    one_pass = OnePassStep(StageZero(FusedAdamW(param_groups(fused_model, 0.1), **settings)))
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
        one_pass.optimizer_step()
        one_pass.zero_grad()
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


# ---------------------------------------------------------------------------
# The CUDA sources compile (where nvcc exists)

NVCC = toolchain.find_nvcc() or shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no nvcc here")
@pytest.mark.parametrize("source", ["fused_adamw.cu", "fused_norm.cu", "fused_norm_backward.cu",
                                    "fused_bias_gelu.cu", "fused_cross_entropy.cu"])
def test_cuda_source_compiles_for_sm90(source, tmp_path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    command = [NVCC, "-c", str(REPO / "kernels" / source), "-o", str(tmp_path / "out.o"), *loader.NVCC_FLAGS,
               *toolchain.gencode_flags([toolchain.CudaArch(9, 0)]), *COMMON_NVCC_FLAGS, f"-I{REPO / 'kernels'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning" not in result.stderr.lower(), result.stderr[-3000:]


class ReferenceExtension:
    """Stands in for the CUDA extensions with the torch references, same signatures as the bindings."""

    def norm_fwd(self, x, weight, bias, eps, rms, out_code):
        return list(custom_ops._norm_fwd_reference(x, weight, bias, eps, rms,
                                                  custom_ops._CODE_DTYPES.get(out_code, x.dtype)))

    def norm_bwd(self, dy, x, weight, mean, rstd, rms):
        return list(custom_ops._norm_bwd_reference(dy, x, weight, mean, rstd, rms))

    def bias_gelu_fwd(self, h, bias):
        return custom_ops._bias_gelu_reference(h, bias)

    def bias_gelu_bwd(self, dy, h, bias):
        return list(custom_ops._bias_gelu_bwd_reference(dy, h, bias))

    def cross_entropy_fwd(self, logits, targets, ignore_index, classes):
        return list(custom_ops._cross_entropy_fwd_reference(logits, targets, ignore_index, classes))

    def cross_entropy_bwd(self, dloss, logits, targets, lse, ignore_index, classes):
        return custom_ops._cross_entropy_bwd_reference(dloss, logits, targets, lse, ignore_index, classes)


def test_eager_autograd_functions_match_the_custom_ops(monkeypatch):
    d = dict(dtype=torch.float64, requires_grad=True)
    cases = [
        (lambda x, w, b: custom_ops.layer_norm(x, w, b, 1e-5), (torch.randn(3, 4, 9, **d), torch.randn(9, **d),
                                                               torch.randn(9, **d))),
        (lambda x, w: custom_ops.rms_norm(x, w, 1e-6), (torch.randn(5, 9, **d), torch.randn(9, **d))),
        (custom_ops.bias_gelu, (torch.randn(5, 7, **d), torch.randn(7, **d))),
        (lambda z: custom_ops.cross_entropy(z, torch.tensor([0, 12, -100, 5])), (torch.randn(4, 13, **d),)),
        (lambda z: custom_ops.cross_entropy(z, torch.tensor([0, 12, -100, 5]), classes=13), (torch.randn(4, 16, **d),)),
    ]
    expected = []
    for fn, inputs in cases:
        out = fn(*inputs)
        expected.append((out.detach(), torch.autograd.grad(out.sum(), inputs)))
    monkeypatch.setattr(custom_ops, "_ext", lambda extension, *tensors: ReferenceExtension())
    for (fn, inputs), (out_ref, grads_ref) in zip(cases, expected):
        out = fn(*inputs)
        if out.dim():  # the eager path ran (the loss is a mean over its per-row output)
            assert type(out.grad_fn).__name__.endswith("FunctionBackward"), type(out.grad_fn).__name__
        torch.testing.assert_close(out, out_ref)
        for got, want in zip(torch.autograd.grad(out.sum(), inputs), grads_ref):
            torch.testing.assert_close(got, want)

