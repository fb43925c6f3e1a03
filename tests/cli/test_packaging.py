"""A non-editable `pip install .` carries the schema, recipes and kernel sources,
so `toolkit run recipes/quickstart.json` works from any directory."""
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import toolkit

from tests.conftest import REPO


def _venv_seeing_this_environment(venv) -> "Path":
    """A new venv whose interpreter also sees this interpreter's site-packages (torch and friends).

    NOTE: `--system-site-packages` would point at the *base* interpreter, which lacks torch when the
    tests run in a venv (the README's set-up); a .pth file listing this interpreter's site-packages
    works in both. The listed paths are plain entries, so their own .pth files (an editable toolkit's
    finder among them) are not run: the new venv's toolkit is the one it installs.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    own = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    outer = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    Path(own, "_outer_environment.pth").write_text("".join(f"{p}\n" for p in outer if os.path.isdir(p)))
    return py


@pytest.mark.slow
def test_non_editable_install_runs_quickstart_from_another_directory(tmp_path):
    venv = tmp_path / "venv"
    py = _venv_seeing_this_environment(venv)
    # A copy of the sources: setuptools writes build/ and *.egg-info next to what it builds.
    source = tmp_path / "source"
    for name in ("toolkit", "schemas", "recipes", "kernels", "benchmarks"):  # benchmarks/: present, not shipped
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    # No network: pip and setuptools (the `test` extra brings it) come from this environment, no index is read.
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           "--ignore-installed", str(source)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    installed = [line.split(",")[0] for record in venv.glob("lib/python*/site-packages/toolkit-*.dist-info/RECORD")
                 for line in record.read_text().splitlines()]
    assert any(path.startswith("toolkit/_shipped/kernels/") for path in installed), installed
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "toolkit").rglob("*.py") if "__pycache__" not in p.parts}
    assert not sources - set(installed), sorted(sources - set(installed))  # a subpackage missing from pyproject
    benchmark_code = [path for path in installed
                      if path.startswith("benchmarks/") or Path(path).name.startswith("bench")]
    assert not benchmark_code, benchmark_code  # issue 19: the wheel carries no benchmark, tuner or device script
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    where = subprocess.run([str(py), "-c", "import toolkit, toolkit.resources as r; print(toolkit.__file__); "
                            "print(r.schema_path())"], cwd=workdir, env=env, capture_output=True, text=True, check=True)
    module_file, schema = where.stdout.split()
    assert module_file.startswith(str(venv)), module_file
    assert schema.startswith(str(venv)) and os.path.isfile(schema)
    proc = subprocess.run([str(venv / "bin" / "toolkit"), "run", "recipes/quickstart.json", "--run-dir", "run",
                           "training.max_steps=3", "scheduler.type=constant", "training.eval_interval=0",
                           "training.log_interval=1", "logging.console=false"],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (workdir / "run" / "metrics.jsonl").read_text().count('"loss"') == 3
    results = subprocess.run([str(py), "-c", "import toolkit.resources as r; print(r.results_path())"],
                             cwd=workdir, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert results == str(Path(module_file).parent / "_shipped" / "benchmarks" / "RESULTS.md"), results
    assert Path(results).read_bytes() == (REPO / "benchmarks" / "RESULTS.md").read_bytes()  # the notebooks quote it
    kernels = subprocess.run([str(py), "-c", "import toolkit.resources as r; print(r.shipped_dir('kernels'))"],
                             cwd=workdir, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert kernels.startswith(str(venv))
    version = subprocess.run([str(venv / "bin" / "toolkit"), "--version"], cwd=workdir, env=env, capture_output=True,
                             text=True, check=True).stdout
    assert version.startswith(f"toolkit {toolkit.__version__} from {venv}"), version  # pyproject reads __version__
    hint = subprocess.run([str(py), "-c", "from toolkit.optional_packages import install_command; "
                           "print(install_command('parquet'))"], cwd=workdir, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert hint == f'pip install "{source}[parquet]"', hint  # the folder pip recorded (PEP 610), not the index


def test_results_md_ships_where_resources_looks_for_it(tmp_path, monkeypatch):
    """The tutorials read benchmarks/RESULTS.md through toolkit.resources; pyproject.toml copies that file to the
    path `results_path()` takes in an installed package (the slow test above installs one)."""
    import tomllib

    from toolkit import resources

    assert resources.results_path() == REPO / "benchmarks" / "RESULTS.md"  # in a checkout: the file itself
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    installed_at = {}  # source file -> its path in site-packages
    for package, patterns in setuptools["package-data"].items():
        for pattern in patterns:
            source = (REPO / setuptools["package-dir"][package] / pattern).resolve()
            installed_at[source] = Path(os.path.normpath(Path(*package.split(".")) / pattern))
    monkeypatch.setattr(resources, "_PACKAGE", tmp_path / "site-packages" / "toolkit")  # an installed package
    assert resources.results_path() == tmp_path / "site-packages" / installed_at[(REPO / "benchmarks" / "RESULTS.md")]
