"""A base install (no extras) through the real CLI: a missing optional package is one line
naming the recipe key (or command) that needs it and the `pip install "toolkit[extra]"`
that brings it, exit 2, found by `validate` already and by `run` before any work.

A package is made missing by a sitecustomize.py on PYTHONPATH that puts None in
sys.modules for it: `import` then raises ModuleNotFoundError and find_spec says absent,
as in an environment that never installed it.
"""
import json
import os
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO, run_cli
from toolkit.optional_packages import OPTIONAL_PACKAGES


@pytest.fixture
def without(tmp_path, monkeypatch):
    """without("tensorboard", ...): later run_cli calls run as if those packages were not installed."""
    def block(*modules: str) -> None:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(f"import sys\nfor name in {modules!r}:\n    sys.modules[name] = None\n")
        monkeypatch.setenv("PYTHONPATH", str(site))
    return block


def _one_error_line(proc, *parts: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("override, module, extra", [
    ("logging.tensorboard=true", "tensorboard", "dashboards"),
    ("logging.wandb.mode=offline", "wandb", "dashboards"),
])
def test_validate_names_the_key_and_the_extra_without_importing_torch(without, override, module, extra):
    without(module, "torch")  # torch blocked too: validate must not import it
    proc = run_cli("validate", "quickstart", override)
    _one_error_line(proc, f"recipe.{override.split('=')[0]}", f"'{module}'", f'pip install "toolkit[{extra}]"')


def test_validate_names_pyarrow_for_a_parquet_recipe(without, tmp_path):
    (tmp_path / "part.parquet").write_bytes(b"PAR1")
    recipe = {"model": {"family": "gpt2", "size": "tiny"},
              "data": {"kind": "parquet", "paths": ["*.parquet"], "tokenizer": "byte", "seq_len": 32},
              "batch": {"micro_batch_per_rank": 2}, "training": {"max_steps": 2}}
    (tmp_path / "r.json").write_text(json.dumps(recipe))
    without("pyarrow", "torch")
    proc = run_cli("validate", str(tmp_path / "r.json"))
    _one_error_line(proc, "recipe.data.kind 'parquet'", "'pyarrow'", 'pip install "toolkit[parquet]"')


def test_run_without_tensorboard_is_one_line_and_leaves_no_run_dir(without, tmp_path):
    without("tensorboard")
    run_dir = tmp_path / "run"
    proc = run_cli("run", "quickstart", "logging.tensorboard=true", "--run-dir", str(run_dir), timeout=60)
    _one_error_line(proc, "recipe.logging.tensorboard true", 'pip install "toolkit[dashboards]"')
    assert not run_dir.exists()


def test_run_without_matplotlib_trains_and_notes_the_missing_plot(without, tmp_path):
    without("matplotlib")
    run_dir = tmp_path / "run"
    proc = run_cli("run", "quickstart", "training.max_steps=3", "scheduler.warmup_num_steps=1",
                   "training.eval_batches=0", "checkpoint.save_final=false", "--run-dir", str(run_dir), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'no memory.png: matplotlib is not installed; pip install "toolkit[dashboards]"' in proc.stdout
    assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / "memory.png").exists()


def test_tutorials_build_names_the_tutorials_extra(without):
    without("jinja2")
    proc = run_cli("tutorials", "build", "--check")
    _one_error_line(proc, "toolkit tutorials build", "'jinja2'", 'pip install "toolkit[tutorials]"')


def test_doctor_lines_say_how_to_install_a_missing_package(without):
    without("wandb")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ["PYTHONPATH"]}
    out = subprocess.run([sys.executable, "-c", "from toolkit.optional_packages import doctor_lines; "
                          "print('\\n'.join(doctor_lines()))"], env=env, capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("wandb"))
    assert 'missing (pip install "toolkit[dashboards]")' in line and "recipe.logging.wandb.mode" in line


def test_every_extra_in_the_table_installs_its_package():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for pkg in OPTIONAL_PACKAGES:
        names = [req.split(">")[0].split("=")[0].split("[")[0].strip().lower() for req in extras[pkg.extra]]
        assert pkg.module in names, (pkg.module, pkg.extra, names)
