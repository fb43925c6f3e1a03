"""The bf16-state CPU Adam step gives the same bits in every build of kernels/cpu_adam_bf16.cpp: the flag sets the
loader tries (-march=native: AVX-512 or AVX2 lanes; without it: the scalar loop), compiled around a small C++
harness (tests/ops/cpu_adam_bf16_harness.cpp), so a checkpoint's rounding does not depend on the host's ISA.
Without -ffp-contract=off in those flags GCC fuses multiplies and adds in the vector build and this test fails
(a few moments one ulp apart on an AVX2 host)."""
import shutil
import subprocess

import pytest

from tests.conftest import REPO
from toolkit.ops.loader import EXTENSIONS

KERNELS = REPO / "kernels"


def _run_build(flags: tuple[str, ...], tmp_path) -> bytes:
    binary, output = tmp_path / f"harness{len(list(tmp_path.iterdir()))}", tmp_path / "out.bin"
    subprocess.run(["g++", "-std=c++17", *flags, f"-I{KERNELS}", str(REPO / "tests/ops/cpu_adam_bf16_harness.cpp"),
                    str(KERNELS / "cpu_adam_bf16.cpp"), "-o", str(binary)], check=True, capture_output=True,
                   timeout=120)
    subprocess.run([str(binary), str(output)], check=True, timeout=60)
    return output.read_bytes()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++, as the kernel's build does")
def test_every_flag_set_of_the_cpu_adam_build_steps_bf16_states_to_the_same_bits(tmp_path):
    flag_sets = EXTENSIONS["cpu_adam"].cxx_flag_sets
    assert any("-march=native" in flags for flags in flag_sets) and any("-march=native" not in f for f in flag_sets)
    results = [_run_build(flags, tmp_path) for flags in flag_sets]
    assert len(results[0]) == 6 * 4 * 100003 * 2
    assert all(r == results[0] for r in results[1:])
