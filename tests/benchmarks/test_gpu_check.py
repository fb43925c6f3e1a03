"""benchmarks/gpu_check.sh's stage machinery on the CPU: a failing stage reaches the call's exit code and
its summary line, whatever `| tee` sits behind it.

The script runs from the repository root as on the device, with `python3` on PATH standing for this
interpreter, no carried wheels, and TEST_TARGETS pointing its `tests` stage at small pytest targets
written here (the device's CUDA tests would only skip on this machine)."""
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


@pytest.fixture
def gpu_check(tmp_path):
    """run(*stages, tests=TARGET, NAME=value...) -> (exit code, output) of `bash benchmarks/gpu_check.sh STAGES`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # a wrapper, not a symlink: a venv's python must be called by its own path
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    (tmp_path / "no-wheels").mkdir()

    def run(*stages, tests=None, **variables):
        env = {**os.environ, **variables, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
               "WHEELS": str(tmp_path / "no-wheels"), "OMP_NUM_THREADS": "1"}
        if tests is not None:
            env["TEST_TARGETS"] = str(tests)
        proc = subprocess.run(["bash", str(SCRIPT), *stages], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
        return proc.returncode, proc.stdout

    return run


def summary(output: str) -> list[tuple[str, str]]:
    """The closing summary's lines as (stage, verdict), in order."""
    assert "=== summary" in output, output
    lines = output.split("=== summary", 1)[1].strip().splitlines()
    return [re.fullmatch(r"(\S+)\s+(.+)", line).groups() for line in lines]


def test_a_pytest_that_cannot_start_fails_the_call_and_its_summary_line(gpu_check, tmp_path):
    """The incident of issue 19: a plugin (here a conftest) that fails to import stops pytest before any test."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "conftest.py").write_text("raise ImportError(\"No module named 'nbformat'\")\n")
    (broken / "test_fine.py").write_text("def test_fine():\n    assert True\n")
    code, output = gpu_check("tests", tests=broken)
    assert code == 4, output  # pytest's usage error: it could not load its conftest
    assert summary(output) == [("tests", "FAILED rc 4"), ("logs.tgz", "ok")]


def test_no_test_collected_or_passed_fails_the_tests_stage(gpu_check, tmp_path):
    empty = tmp_path / "test_empty.py"
    empty.write_text('"""no tests here"""\n')
    code, output = gpu_check("tests", tests=empty)
    assert code == 5, output  # pytest's "no tests collected"
    assert summary(output)[0] == ("tests", "FAILED rc 5")
    skipped = tmp_path / "test_skipped.py"  # every test skipped: what the CUDA tests do without a GPU
    skipped.write_text("import pytest\n\n\n@pytest.mark.skip(reason='no GPU')\ndef test_gpu():\n    pass\n")
    code, output = gpu_check("tests", tests=skipped)
    assert code == 1, output
    assert "tests: no test passed" in output
    assert summary(output)[0] == ("tests", "FAILED rc 1")


def test_every_stage_gets_a_line_and_the_first_failure_sets_the_exit_code(gpu_check, tmp_path):
    passing = tmp_path / "test_passing.py"
    passing.write_text("def test_passing():\n    assert 1 + 1 == 2\n")
    code, output = gpu_check("tests", tests=passing)
    assert code == 0, output
    assert summary(output) == [("tests", "ok"), ("logs.tgz", "ok")]
    code, output = gpu_check("tests", "no-such-stage", "tests", tests=passing)
    assert code == 2, output
    assert "unknown stage 'no-such-stage'" in output
    assert summary(output) == [("tests", "ok"), ("no-such-stage", "FAILED rc 2"), ("tests", "ok"), ("logs.tgz", "ok")]


def test_a_stage_that_skips_itself_says_so_in_the_summary(gpu_check):
    """e2e only runs while the call is young (E2E_BY seconds): past that it is skipped, not ok and not failed."""
    code, output = gpu_check("e2e", E2E_BY="0")
    assert code == 0, output
    (stage, verdict), _ = summary(output)
    assert stage == "e2e" and verdict.startswith("skipped: "), output


@pytest.mark.parametrize("together", ["", "1"], ids=["each alone", "together"])
def test_treeab_alternates_todays_configurations_and_the_baseline_tree(gpu_check, tmp_path, together):
    """treeab: per alternation, today's AB_ONLY configurations (each in its own process, or with AB_TOGETHER=1
    interleaved in one), then BASELINE_ONLY run from BASELINE_TREE; AB_MICRO and AB_ROUNDS reach every run. The
    benchmark itself is stood in for by a python3 that records its arguments and the folder it ran in."""
    log, baseline = tmp_path / "calls.txt", tmp_path / "baseline-tree"
    baseline.mkdir()
    python3 = tmp_path / "bin" / "python3"
    python3.write_text(f'#!/bin/sh\nif [ "$2" = benchmarks.end_to_end ]; then echo "$PWD|$*" >> "{log}"; '
                       f'exit 0; fi\nexec "{sys.executable}" "$@"\n')
    code, output = gpu_check("treeab", AB_N="2", AB_ONLY="a,b", AB_MICRO="16", AB_ROUNDS="5", AB_TOGETHER=together,
                             BASELINE_ONLY="a", BASELINE_TREE=str(baseline))
    assert code == 0, output
    calls = [line.split("|") for line in log.read_text().splitlines()]
    today = [["--only a"], ["--only b"]] if not together else [["--only a,b"]]
    want = (today + [["--only a", "baseline"]]) * 2
    assert len(calls) == len(want), calls
    for (where, args), words in zip(calls, want):
        assert words[0] in args and "--micro 16" in args and "--rounds 5" in args, args
        assert (where == str(baseline)) == (words[-1] == "baseline"), (where, args)


def test_recipes_alternates_the_allocator_settings_per_recipe(gpu_check, tmp_path, monkeypatch):
    """recipes with RECIPES_ALLOC and RECIPES_ROUNDS: per recipe, the rounds of each setting in turn, each run with
    PYTORCH_CUDA_ALLOC_CONF set to it ("default": the variable unset) and labelled so. The timed `toolkit run` is
    stood in for by a python3 that records the setting and its arguments."""
    log = tmp_path / "calls.txt"
    python3 = tmp_path / "bin" / "python3"
    python3.write_text(f'#!/bin/sh\nif [ "$2" = benchmarks.first_step ]; then '
                       f'echo "${{PYTORCH_CUDA_ALLOC_CONF-unset}}|$*" >> "{log}"; exit 0; fi\n'
                       f'exec "{sys.executable}" "$@"\n')
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "x")  # (set first, so the monkeypatch restores it)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")  # the script's runs inherit this environment
    code, output = gpu_check("recipes", RECIPES="r1:5 r2:7:a.b=1", RECIPES_ROUNDS="2",
                             RECIPES_ALLOC="default expandable_segments:True")
    assert code == 0, output
    calls = [line.split("|") for line in log.read_text().splitlines()]
    settings = ["unset", "expandable_segments:True"] * 2
    assert [setting for setting, _ in calls] == settings * 2
    for (setting, args), recipe in zip(calls, ["r1"] * 4 + ["r2"] * 4):
        assert f"recipes/{recipe}.json" in args and (setting == "unset") != ("expandable_segments:True" in args)
    assert "training.max_steps=7 checkpoint.save_final=false a.b=1" in calls[-1][1]
