"""The CPU Adam kernel (kernels/cpu_adam.cpp) against torch.optim.AdamW, its bf16
copy-out, the sharded AdamW's reference path (bit-identical to torch), and the
fallback when the kernel cannot be used (one warning naming the reason)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from toolkit.ops.cpu_adam import cpu_adam_status, load_cpu_adam

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


@pytest.fixture(scope="module")
def kernel():
    module = load_cpu_adam()
    if module is None:
        pytest.skip(f"CPU Adam kernel not built here: {cpu_adam_status().reason}")
    return module


def relative_to_scale(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: relative error at the tensor's own scale."""
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("numel", [1, 17, 4099, 300_007])  # scalar tail, one vector, several, many threads' blocks
def test_cpu_adam_matches_torch_adamw_within_1e_6_relative(kernel, numel):
    # NOTE: "relative" at each tensor's scale: the kernel and torch round the update a different
    # way (fused multiply-adds, a refined reciprocal), a few ulp of the operands; for a parameter
    # the update has pushed through zero that is a large ratio of the tiny result, not an error.
    gen = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=gen)
    ref = param.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    m, v = torch.zeros(numel), torch.zeros(numel)
    for step in range(1, 21):
        grad = torch.randn(numel, generator=gen) * (10.0 ** (step % 5 - 2))  # gradients over five decades
        ref.grad = grad.clone()
        opt.step()
        kernel.adamw_step(param, grad, m, v, step, LR, BETAS[0], BETAS[1], EPS, WD)
    state = opt.state[ref]
    assert relative_to_scale(param, ref.detach()) <= 1e-6
    assert relative_to_scale(m, state["exp_avg"]) <= 1e-6
    assert relative_to_scale(v, state["exp_avg_sq"]) <= 1e-6


def test_cpu_adam_writes_bf16_params_in_the_same_pass(kernel):
    p, g = torch.randn(10_001), torch.randn(10_001)
    out = torch.empty(10_001, dtype=torch.bfloat16)
    kernel.adamw_step(p, g, torch.zeros_like(p), torch.zeros_like(p), 1, LR, *BETAS, EPS, WD, out)
    assert torch.equal(out, p.to(torch.bfloat16))


@pytest.mark.parametrize("numel", [17, 300_007])  # one tile's tail; many threads' blocks
def test_cpu_adam_extrapolates_the_bf16_copy_as_torch_adds_it_bit_for_bit(kernel, numel):
    # zero.offload_update delayed_extrapolated: the copy is new + (new - old), written in the update's pass;
    # the weights and moments are the plain step's, and the copy is torch's add(new, new - old) rounded to bf16
    gen = torch.Generator().manual_seed(numel)
    p, g, m, v = (torch.randn(numel, generator=gen) for _ in range(4))
    m, v = m * 0.1, v.abs() * 0.01
    old = p.clone()
    plain = [t.clone() for t in (p, g, m, v)]
    out = torch.empty(numel, dtype=torch.bfloat16)
    kernel.adamw_step(p, g, m, v, 3, LR, *BETAS, EPS, WD, out, False, True)
    kernel.adamw_step(*plain, 3, LR, *BETAS, EPS, WD)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), (plain[0], plain[2], plain[3])))
    assert torch.equal(out, torch.add(plain[0], plain[0] - old).to(torch.bfloat16))
    assert not torch.equal(out, p.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="param_bf16"):
        kernel.adamw_step(p, g, m, v, 4, LR, *BETAS, EPS, WD, None, False, True)


def test_cpu_adam_zeroes_the_consumed_gradient_when_asked(kernel):
    p, g = torch.randn(70_001), torch.randn(70_001)
    want = p.clone()
    kernel.adamw_step(want, g.clone(), torch.zeros_like(p), torch.zeros_like(p), 1, LR, *BETAS, EPS, WD)
    kernel.adamw_step(p, g, torch.zeros_like(p), torch.zeros_like(p), 1, LR, *BETAS, EPS, WD, None, True)
    assert torch.equal(p, want) and not g.any()


@pytest.mark.parametrize("states", ["fp32", "bf16"])
@pytest.mark.parametrize("numel", [17, 300_007])  # one tile's tail; many threads' blocks
def test_grad_scales_multiply_the_gradient_first_as_torch_mul_does_bit_for_bit(kernel, states, numel):
    # a delayed offload update's gradient copy, taken before the clip (and an fp16 unscale) multiplied the device's
    # gradients: the kernel multiplies it in its pass, each factor in turn as a float, as g.mul_(factor) would
    gen = torch.Generator().manual_seed(numel)
    scales = [0.2137654321987, 1 / 3.0]  # doubles whose float rounding matters
    g = torch.randn(numel, generator=gen) * 3.7
    if states == "fp32":
        p, m, v = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 0.1, torch.rand(numel) * 0.01
        want, got = [t.clone() for t in (p, m, v)], [p, m, v]
        step = lambda w, grad, **kw: kernel.adamw_step(w[0], grad, w[1], w[2], 3, LR, *BETAS, EPS, WD, **kw)
    else:
        _, got = _bf16_states(numel, 4)
        want = [t.clone() for t in got]
        step = lambda w, grad, **kw: kernel.adamw_step_bf16(w[0], grad, w[1], w[2], 3, LR, *BETAS, EPS, WD, 9, 0, **kw)
    scaled, before = g.clone(), g.clone()
    for factor in scales:
        scaled.mul_(factor)
    step(want, scaled)
    step(got, g, grad_scales=scales)
    assert all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b) for a, b in zip(got, want))
    assert torch.equal(g, before)  # read through a stack tile: no write back to memory
    assert not torch.equal(scaled, (g.double() * scales[0] * scales[1]).float())  # the order and rounding matter


def test_cpu_adam_zero_gradients_keep_zero_moments(kernel):
    p = torch.randn(64)
    m, v = torch.zeros(64), torch.zeros(64)
    before = p.clone()
    kernel.adamw_step(p, torch.zeros(64), m, v, 1, LR, *BETAS, EPS, 0.0)
    assert torch.equal(p, before) and not m.any() and not v.any()


def test_sharded_reference_step_is_bit_identical_to_torch_adamw():
    from toolkit.specs import OptimizerSpec
    from toolkit.runtime.zero.adamw import ShardedAdamW

    spec = OptimizerSpec(type="adamw", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, implementation="torch")
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, generator=gen), torch.randn(8, generator=gen)
    refs = [w.clone().requires_grad_(), b.clone().requires_grad_()]
    opt = torch.optim.AdamW([{"params": [refs[0]], "weight_decay": WD}, {"params": [refs[1]], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    sharded = ShardedAdamW(spec, 48, torch.device("cpu"), offload=False)
    assert sharded.mode == "reference"
    moments = {True: ([sharded.exp_avg[:40]], [sharded.exp_avg_sq[:40]]),
               False: ([sharded.exp_avg[40:]], [sharded.exp_avg_sq[40:]])}
    for _ in range(5):
        gw, gb = torch.randn(40, generator=gen), torch.randn(8, generator=gen)
        refs[0].grad, refs[1].grad = gw.clone(), gb.clone()
        opt.step()
        sharded.step({True: [w], False: [b]}, {True: [gw], False: [gb]}, moments)
    assert torch.equal(w, refs[0].detach()) and torch.equal(b, refs[1].detach())


def test_fallback_warns_once_with_the_reason():
    code = ("import torch\n"
            "from toolkit.specs import OptimizerSpec\n"
            "from toolkit.runtime.zero.adamw import ShardedAdamW\n"
            "spec = OptimizerSpec('adamw', 1e-3, (0.9, 0.95), 1e-8, 0.1, 'auto')\n"
            "a = ShardedAdamW(spec, 8, torch.device('cpu'), offload=True)\n"
            "b = ShardedAdamW(spec, 8, torch.device('cpu'), offload=True)\n"
            "print(a.mode, b.mode)\n")
    env = {"PYTHONPATH": str(REPO), "TOOLKIT_DISABLE_CPU_ADAM": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["fused", "fused"]  # torch's fused CPU AdamW instead
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "TOOLKIT_DISABLE_CPU_ADAM" in warnings[0]


def test_a_cached_build_loads_in_a_fresh_process_from_another_install_without_compiling(kernel, tmp_path):
    # A second checkout or a `pip install .` holds the same source at another path, with a newer mtime:
    # torch's ninja rebuilt the cached library for either (94 s on the 2-core VM) and called it "loaded".
    build_dir = Path(cpu_adam_status().where)
    library = next(build_dir.glob("*.so"))
    before = library.stat().st_mtime_ns
    copy = tmp_path / "install"
    copy.mkdir()
    for name in ("toolkit", "kernels", "schemas"):
        shutil.copytree(REPO / name, copy / name)  # new files: new mtimes
    shutil.copy(REPO / "pyproject.toml", copy)
    code = ("import time, torch\nstart = time.perf_counter()\nimport toolkit\n"
            "from toolkit.ops.cpu_adam import cpu_adam_status, load_cpu_adam\n"
            "assert load_cpu_adam() is not None\nprint(toolkit.__file__)\nprint(cpu_adam_status().state)\n"
            "print(f'{time.perf_counter() - start:.2f}')\n")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    where, state, seconds = proc.stdout.split()
    assert where.startswith(str(copy)) and state == "loaded"
    assert "building" not in proc.stderr and library.stat().st_mtime_ns == before, proc.stderr
    print(f"cached load in a fresh process: {seconds} s")


def test_a_first_build_says_what_it_builds_where_and_how_long_it_took(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    import torch.utils.cpp_extension

    from toolkit.ops import cpu_adam, loader
    from toolkit.ops.build_cache import DONE_FILE

    monkeypatch.setenv("TOOLKIT_KERNELS_CACHE", str(tmp_path))
    for loaded in ("_modules", "_loaded", "_failures"):  # this process has not loaded or tried the kernel
        monkeypatch.setattr(loader, loaded, {})
    calls = []

    def fake_load(name, sources, build_directory, **kwargs):
        assert not (Path(build_directory) / "lock").exists()  # the killed build's baton is gone
        assert "note: building the CPU Adam kernel" in capsys.readouterr().err  # said before the compile
        calls.append((name, sources, build_directory))
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return SimpleNamespace(simd_width=lambda: "avx2", omp_threads=lambda: 1)

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    stale = loader.build_plan("cpu_adam").directory  # the first flag set's folder: -march=native
    assert stale.parent == tmp_path and stale.name.startswith("cpu_adam-")
    stale.mkdir()
    (stale / "lock").touch()  # torch's FileBaton left by a build killed midway: load() would wait on it forever
    assert cpu_adam.load_cpu_adam() is not None
    (name, sources, build_directory), = calls
    assert build_directory == str(stale)
    err = capsys.readouterr().err
    # copies in the cache: the package's path is not in the build
    assert sources == [str(stale / "cpu_adam.cpp"), str(stale / "cpu_adam_bf16.cpp")]
    assert (stale / "cpu_adam.cpp").read_bytes() == (REPO / "kernels" / "cpu_adam.cpp").read_bytes()
    assert re.fullmatch(r"note: CPU Adam kernel ready after \d+ s", err.strip())
    assert cpu_adam.cpu_adam_status().state == "built" and (stale / DONE_FILE).is_file()


def _bf16_states(numel: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return gen, [torch.randn(numel, generator=gen).bfloat16(), torch.zeros(numel, dtype=torch.bfloat16),
                 torch.zeros(numel, dtype=torch.bfloat16)]


@pytest.mark.parametrize("offset", [5000, 2**32 - 37, 3 * 2**32 - 5], ids=["small", "across 2^32", "across 3*2^32"])
def test_bf16_states_step_matches_its_torch_reference_but_for_rare_one_ulp_roundings(kernel, offset):
    """adamw_step_bf16 against low_precision_adamw.hashed_bf16_adam_update_ (the same hash, torch's ops): the fp32
    maths may differ by an ulp (fused multiply-adds), which moves a stochastic rounding across a bf16 boundary for
    a handful of elements: at most 1e-4 of them, by one bf16 ulp. Offsets whose lanes cross a multiple of 2^32
    check the kernel's hash of the index's high word (two per vector, chosen by the carry)."""
    from toolkit.runtime.low_precision_adamw import hashed_bf16_adam_update_

    numel = 300_007 if offset == 5000 else 20_011
    gen, states = _bf16_states(numel, 0)
    ref = [t.clone() for t in states]
    for step in range(1, 11):
        grad = torch.randn(numel, generator=gen) * 10.0 ** (step % 5 - 2)
        kernel.adamw_step_bf16(*states[:1], grad, *states[1:], step, LR, *BETAS, EPS, WD, 1234, offset)
        hashed_bf16_adam_update_(ref[0], grad, ref[1], ref[2], seed=1234, offset=offset, step=step, lr=LR, wd=WD,
                                 betas=BETAS, eps=EPS, l2=False)
    for got, want in zip(states, ref):
        ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1 and int((ulps > 0).sum()) <= 1e-4 * numel


def test_bf16_states_step_does_not_depend_on_how_the_shard_is_cut(kernel):
    numel, cut = 200_003, 77_777
    gen, whole = _bf16_states(numel, 1)
    parts = [t.clone() for t in whole]
    for step in range(1, 4):
        grad = torch.randn(numel, generator=gen)
        kernel.adamw_step_bf16(whole[0], grad, whole[1], whole[2], step, LR, *BETAS, EPS, WD, 7, 0)
        for lo, hi in ((0, cut), (cut, numel)):
            kernel.adamw_step_bf16(parts[0][lo:hi], grad[lo:hi], parts[1][lo:hi], parts[2][lo:hi], step, LR, *BETAS,
                                   EPS, WD, 7, lo)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts))
    # the seed picks the bits: the same step under another seed rounds some elements the other way
    _, (a, ma, va) = _bf16_states(numel, 2)
    b, mb, vb = a.clone(), ma.clone(), va.clone()
    grad = torch.randn(numel, generator=gen)
    kernel.adamw_step_bf16(a, grad, ma, va, 1, LR, *BETAS, EPS, WD, 7, 0)
    kernel.adamw_step_bf16(b, grad, mb, vb, 1, LR, *BETAS, EPS, WD, 8, 0)
    assert 0 < int((a != b).sum()) < numel


@pytest.mark.parametrize("extrapolate", [False, True], ids=["copy", "extrapolated"])
def test_bf16_states_step_writes_the_weights_copy_in_its_pass_as_torch_would_after_it(kernel, extrapolate):
    """param_bf16 gets the new weights' bits (or, extrapolating, new + (new - old) rounded to nearest, as
    ShardedAdamW.update's torch ops do it without the kernel), and the states are those of a step without it.
    An odd length runs the padded last vector too; a NaN gradient checks that the copy keeps NaN."""
    numel = 100_003
    gen, states = _bf16_states(numel, 3)
    plain = [t.clone() for t in states]
    for step in range(1, 4):
        grad = torch.randn(numel, generator=gen)
        grad[17] = float("nan")
        old = states[0].float()
        out = torch.empty(numel, dtype=torch.bfloat16)
        kernel.adamw_step_bf16(states[0], grad, states[1], states[2], step, LR, *BETAS, EPS, WD, 5, 11, out,
                               extrapolate)
        kernel.adamw_step_bf16(plain[0], grad, plain[1], plain[2], step, LR, *BETAS, EPS, WD, 5, 11)
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(states, plain))
        if extrapolate:  # ShardedAdamW.update's scratch path: delta = old (fp32); delta = p - delta; out = p + delta
            delta = torch.sub(states[0], old)
            want = torch.empty(numel, dtype=torch.bfloat16)
            torch.add(states[0], delta, out=want)
        else:
            want = states[0]
        finite = want.float().isfinite()
        assert torch.equal(out[finite].view(torch.int16), want[finite].view(torch.int16))
        assert out.float().isnan().equal(want.float().isnan())
