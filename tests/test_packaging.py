"""A non-editable `pip install .` carries the schema, recipes and kernel sources,
so `toolkit run recipes/quickstart.json` works from any directory."""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_non_editable_install_runs_quickstart_from_another_directory(tmp_path):
    venv = tmp_path / "venv"
    # System site packages supply torch and friends; the project itself is installed fresh.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(REPO)],
                   check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    where = subprocess.run([str(py), "-c", "import toolkit, toolkit.resources as r; print(toolkit.__file__); "
                            "print(r.schema_path())"], cwd=workdir, env=env, capture_output=True, text=True, check=True)
    module_file, schema = where.stdout.split()
    assert module_file.startswith(str(venv)), module_file
    assert schema.startswith(str(venv)) and os.path.isfile(schema)
    proc = subprocess.run([str(venv / "bin" / "toolkit"), "run", "recipes/quickstart.json", "--run-dir", "run",
                           "training.max_steps=3", "scheduler.type=constant", "training.eval_interval=0", "training.log_interval=1", "logging.console=false"],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (workdir / "run" / "metrics.jsonl").read_text().count('"loss"') == 3
    kernels = subprocess.run([str(py), "-c", "import toolkit.resources as r; print(r.shipped_dir('kernels'))"],
                             cwd=workdir, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert kernels.startswith(str(venv))
