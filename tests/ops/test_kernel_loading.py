"""Fused kernels without a GPU: a build never breaks a run (fallback, errors, status), the
architecture list parses what users set, and the CUDA sources compile for sm_90 with nvcc. The ops
themselves: test_fused_ops.py."""
import re
import sys
import shutil
import subprocess
import warnings

import pytest
import torch

from tests.conftest import REPO, run_cli
from toolkit.ops import custom_ops, loader, norm_ops, op_dispatch, toolchain
from toolkit.ops.op_dispatch import CODE_DTYPES
from toolkit.errors import UserError
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
    """A header left out of its extension's build plan (loader.HEADERS for the CUDA ones, Extension.headers for the
    host one) would let an edit to it reuse a stale build."""
    kernels = REPO / "kernels"
    for name, extension in loader.EXTENSIONS.items():
        included, files = set(), set(extension.sources)
        while files:  # the sources and what they include, transitively
            path = kernels / files.pop()
            found = set(re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M)) - included
            included |= found
            files |= found
        planned = {path.name for path in loader.build_plan(name).headers}
        assert included <= planned, (name, sorted(included - planned))
    assert {path.name for path in loader.build_plan("cpu_adam").headers} == {"cpu_adam_bf16.h"}


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


def test_a_cuda_run_builds_the_kernels_it_needs_together(monkeypatch):
    import threading

    # Each build waits until all four are under way: built one after the other, the first would time out.
    under_way = threading.Barrier(len(GPT2_NEEDS), timeout=10)

    def slow_build(name, build=False):
        assert build
        under_way.wait()
        return loader.KernelStatus(name, "built")

    monkeypatch.setattr(loader, "kernel_status", slow_build)
    chosen = loader.resolve(ALL_AUTO, "cuda", GPT2_NEEDS)
    assert list(chosen.statuses) == list(GPT2_NEEDS) and all(chosen.active(n) for n in GPT2_NEEDS)


def test_nvcc_is_asked_once_per_binary_and_the_answer_kept_in_the_cache(monkeypatch, tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(f"#!/bin/sh\necho \"$1\" >> {tmp_path / 'asked'}\n"
                    "echo 'Cuda compilation tools, release 13.0'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("TOOLKIT_KERNELS_CACHE", str(tmp_path / "cache"))
    for _ in range(3):  # three runs' questions: nvcc answers the first
        assert "release 13.0" in toolchain._nvcc_output("--version")
    assert (tmp_path / "asked").read_text() == "--version\n"
    nvcc.write_text(nvcc.read_text() + "# another build\n")  # a new binary is asked again
    assert "release 13.0" in toolchain._nvcc_output("--version")
    assert (tmp_path / "asked").read_text() == "--version\n--version\n"


def test_builds_started_in_the_background_are_what_the_engine_then_waits_for(monkeypatch, fresh_loader):
    import threading

    # The run starts the builds before it makes the model; resolve, called meanwhile, waits on the same
    # per-extension lock and takes the module the background build made, without a second build.
    release, builds = threading.Event(), []

    def slow_build(plan, verbose=False):
        builds.append(plan.extension)
        assert release.wait(10)
        return object(), True

    monkeypatch.setattr(loader, "_problem", lambda extension: None)
    monkeypatch.setattr(loader, "ninja_problem", lambda: None)
    monkeypatch.setattr(loader, "build_or_import", slow_build)
    loader.build_in_background(GPT2_NEEDS)
    threading.Timer(0.3, release.set).start()
    chosen = loader.resolve(ALL_AUTO, "cuda", GPT2_NEEDS)
    assert all(chosen.active(n) for n in GPT2_NEEDS)
    assert sorted(builds) == sorted({loader.EXTENSION_OF[n] for n in GPT2_NEEDS})  # each once


def test_a_run_starts_builds_only_on_cuda_and_only_of_kernels_not_off(monkeypatch):
    from toolkit.recipe.load import load_recipe
    from toolkit.runtime.engine import kernels_of_recipe
    from toolkit.runtime.kernel_choice import start_kernel_builds

    started = []
    monkeypatch.setattr(loader, "build_in_background", lambda names: started.append(list(names)))
    recipe = load_recipe("gpt2-124m", ["kernels.bias_gelu=off", "zero.stage=0"])
    start_kernel_builds(kernels_of_recipe(recipe), recipe.kernels, torch.device("cpu"))
    assert started == []
    start_kernel_builds(kernels_of_recipe(recipe), recipe.kernels, torch.device("cuda"))
    assert started == [["layernorm", "cross_entropy", "adamw"]]
    stage2 = load_recipe("gpt2-124m", ["zero.stage=2"])
    start_kernel_builds(kernels_of_recipe(stage2), stage2.kernels, torch.device("cuda"))
    assert started[-1] == ["layernorm", "bias_gelu", "cross_entropy"]  # stage 2 steps its shards without it


def test_nvcc_runs_its_two_compilations_and_their_passes_in_parallel_where_it_can():
    assert toolchain.nvcc_parallel_flags("13.0") == ("--threads=0", "--split-compile=0")
    assert toolchain.nvcc_parallel_flags("12.1") == ("--threads=0", "--split-compile=0")
    assert toolchain.nvcc_parallel_flags("12.0") == () and toolchain.nvcc_parallel_flags(None) == ()


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


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """An empty kernel cache, a loader that has loaded nothing, and every compile recorded instead of run."""
    from toolkit.ops import build_cache

    monkeypatch.setenv("TOOLKIT_KERNELS_CACHE", str(tmp_path))
    toolchain.nvcc_version.cache_clear()  # asked again, of this cache: the test does not depend on the order
    for loaded in ("_modules", "_loaded", "_failures"):
        monkeypatch.setattr(loader, loaded, {})
    compiles = []
    monkeypatch.setattr(build_cache, "_compile", lambda plan, verbose: compiles.append(plan) or 1 / 0)
    return compiles


def kernel_line(lines, name):
    return next(line for line in lines if line.split()[0] == name)


def test_doctor_with_an_empty_cache_builds_nothing_and_names_the_command(fresh_loader, monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "build_problem", lambda: None)  # as on a machine with nvcc
    monkeypatch.setattr(loader, "ninja_problem", lambda: None)  # and ninja
    lines = loader.doctor_lines()
    # nothing compiled, no build folder made; the one file doctor may leave is nvcc's remembered answers
    # (toolchain._nvcc_output), which a machine with nvcc writes the first time it asks
    assert fresh_loader == []
    assert [p.name for p in tmp_path.iterdir()] == (["nvcc-answers.json"] if toolchain.find_nvcc() else [])
    for name in loader.KERNELS:
        assert kernel_line(lines, name).startswith(f"{name:<14} not built:")
        assert "(fix: run `toolkit build-kernels` ahead of time)" in kernel_line(lines, name)
    assert kernel_line(lines, "cpu_adam").startswith("cpu_adam       not built:")
    assert "(fix: run `toolkit build-kernels cpu_adam` ahead of time)" in kernel_line(lines, "cpu_adam")


def test_doctor_names_the_log_of_a_build_that_failed_earlier(fresh_loader):
    for variant in range(len(loader.EXTENSIONS["cpu_adam"].cxx_flag_sets)):  # every flag set failed
        plan = loader.build_plan("cpu_adam", variant)
        plan.directory.mkdir()
        plan.log.write_text("cpu_adam.cpp:1: error: no compiler\n")
    line = kernel_line(loader.doctor_lines(), "cpu_adam")
    assert f"not built: the last build here failed (log: {loader.build_plan('cpu_adam', 0).log})" in line
    assert "`toolkit build-kernels cpu_adam --verbose`" in line and fresh_loader == []


def test_doctor_loads_a_cached_cpu_adam_without_building(monkeypatch):
    from toolkit.ops import build_cache
    from toolkit.ops.cpu_adam import cpu_adam_status, load_cpu_adam

    if load_cpu_adam(warn=False) is None:  # builds it into the cache once, as a run would
        pytest.skip(f"CPU Adam kernel not built here: {cpu_adam_status().reason}")
    where = cpu_adam_status().where
    for loaded in ("_modules", "_loaded", "_failures"):  # a new process: only the cache knows the kernel
        monkeypatch.setattr(loader, loaded, {})
    monkeypatch.setattr(build_cache, "_compile", lambda plan, verbose: pytest.fail("doctor compiled a kernel"))
    line = kernel_line(loader.doctor_lines(), "cpu_adam")
    assert line.startswith("cpu_adam       loaded: ") and f"[{where}]" in line
    assert loader.loaded_extension("cpu_adam") is not None


def test_build_kernels_rejects_an_unknown_kernel_in_one_line():
    result = run_cli("build-kernels", "cpu-adam")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: build-kernels: unknown kernel 'cpu-adam'; one of adamw, layernorm, "
                                     "rmsnorm, bias_gelu, cross_entropy, cpu_adam")


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch can build the kernels")
def test_build_kernels_without_cuda_torch_exits_2_saying_how_to_fix():
    result = run_cli("build-kernels", "adamw")
    assert result.returncode == 2
    assert "recipe" not in result.stderr and "install a CUDA build of torch" in result.stderr


# ---------------------------------------------------------------------------
# The CUDA sources compile (where nvcc exists)

NVCC = toolchain.find_nvcc() or shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no nvcc here")
@pytest.mark.parametrize("source", ["fused_adamw.cu", "fused_norm.cu", "fused_norm_backward.cu",
                                    "fused_bias_gelu.cu", "fused_cross_entropy.cu"])
def test_cuda_source_compiles_for_sm90(source, tmp_path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    command = [NVCC, "-c", str(REPO / "kernels" / source), "-o", str(tmp_path / "out.o"), *loader.NVCC_FLAGS,
               *toolchain.nvcc_parallel_flags(toolchain.nvcc_version()),
               *toolchain.gencode_flags([toolchain.CudaArch(9, 0)]), *COMMON_NVCC_FLAGS, f"-I{REPO / 'kernels'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning" not in result.stderr.lower(), result.stderr[-3000:]


class ReferenceExtension:
    """Stands in for the CUDA extensions with the torch references, same signatures as the bindings."""

    def norm_fwd(self, x, weight, bias, eps, rms, out_code):
        return list(norm_ops._norm_fwd_reference(x, weight, bias, eps, rms, CODE_DTYPES.get(out_code, x.dtype)))

    def norm_bwd(self, dy, x, weight, mean, rstd, rms, dresidual=None):
        return list(norm_ops._norm_bwd_reference(dy, x, weight, mean, rstd, rms, dresidual))

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
        # the residual add fused into the norm: both outputs, so the sum's gradient takes the other path too
        (lambda x, r, w, b: torch.cat(custom_ops.add_layer_norm(x, r, w, b, 1e-5), -1),
         (torch.randn(3, 4, 9, **d), torch.randn(3, 4, 9, **d), torch.randn(9, **d), torch.randn(9, **d))),
        (lambda x, r, w: torch.cat(custom_ops.add_rms_norm(x, r, w, 1e-6), -1),
         (torch.randn(5, 9, **d), torch.randn(5, 9, **d), torch.randn(9, **d))),
        (custom_ops.bias_gelu, (torch.randn(5, 7, **d), torch.randn(7, **d))),
        (lambda z: custom_ops.cross_entropy(z, torch.tensor([0, 12, -100, 5])), (torch.randn(4, 13, **d),)),
        (lambda z: custom_ops.cross_entropy(z, torch.tensor([0, 12, -100, 5]), classes=13), (torch.randn(4, 16, **d),)),
    ]
    expected = []
    for fn, inputs in cases:
        out = fn(*inputs)
        expected.append((out.detach(), torch.autograd.grad(out.sum(), inputs)))
    for module in (custom_ops, norm_ops, op_dispatch):  # each holds its own name for it
        monkeypatch.setattr(module, "kernel_module", lambda extension, *tensors: ReferenceExtension())
    for (fn, inputs), (out_ref, grads_ref) in zip(cases, expected):
        out = fn(*inputs)
        if out.dim():  # the eager path ran (the loss is a mean over its per-row output; the add-norms' two outputs cat)
            nodes = [out.grad_fn, *(f for f, _ in out.grad_fn.next_functions if f is not None)]
            assert any(type(f).__name__.endswith("FunctionBackward") for f in nodes), nodes
        torch.testing.assert_close(out, out_ref)
        for got, want in zip(torch.autograd.grad(out.sum(), inputs), grads_ref):
            torch.testing.assert_close(got, want)



def test_a_finished_cuda_build_loads_without_asking_for_ninja(fresh_loader, monkeypatch):
    """A cached start imports the finished library: it needs nvcc's version for the cache key, not the builder
    (ninja is a process to ask, and torch's builder imports setuptools)."""
    from toolkit.ops import build_cache

    asked = []
    monkeypatch.setattr(loader, "build_problem", lambda: asked.append("toolchain"))
    monkeypatch.setattr(loader, "ninja_problem", lambda: 1 / 0)  # never asked on this path
    plan = loader.build_plan("norm")
    plan.directory.mkdir(parents=True)
    plan.library.write_bytes(b"")
    (plan.directory / build_cache.DONE_FILE).write_text("")
    monkeypatch.setattr(build_cache, "_import_library", lambda p: ("imported", p.directory))
    monkeypatch.setattr(loader, "build_or_import", lambda p, verbose=False: (build_cache._import_library(p), False))
    assert loader.load_extension("norm") == ("imported", plan.directory)
    assert asked == ["toolchain"] and fresh_loader == []


def test_an_unfinished_cuda_build_asks_for_the_builder_first(fresh_loader, monkeypatch):
    monkeypatch.setattr(loader, "build_problem", lambda: None)  # nvcc is here
    monkeypatch.setattr(loader, "ninja_problem", lambda: ("ninja is not installed", "pip install ninja"))
    assert loader.load_extension("norm") is None
    status = loader.kernel_status("layernorm")
    assert (status.state, status.reason) == ("unavailable", "ninja is not installed") and fresh_loader == []


def test_finding_nvcc_does_not_import_torchs_extension_builder():
    """find_nvcc follows cpp_extension's guesses for CUDA_HOME without importing it (it imports setuptools)."""
    code = ("import sys; from toolkit.ops import toolchain; toolchain.find_nvcc(); "
            "toolchain.build_problem(); "
            "print('torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_find_nvcc_takes_cuda_home_then_path(monkeypatch, tmp_path):
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert toolchain.find_nvcc() == str(nvcc)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(nvcc.parent))
    nvcc.chmod(0o755)
    assert toolchain.find_nvcc() == str(nvcc)
