"""A base install (no extras) through the real CLI: a missing optional package is one line
naming the recipe key (or command) that needs it and the command that installs its extra
for how this toolkit was installed (never `pip install "toolkit[extra]"`, which is another
project on the public index), exit 2, found by `validate` already and by `run` before any work.

A package is made missing by a sitecustomize.py on PYTHONPATH that puts None in
sys.modules for it: `import` then raises ModuleNotFoundError and find_spec says absent,
as in an environment that never installed it.
"""
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO, run_cli
from toolkit.optional_packages import OPTIONAL_PACKAGES, InstallOrigin, find_install_origin, install_command


def from_checkout(extra: str) -> str:
    """The hint the tests' toolkit gives: it runs from this checkout."""
    return f'pip install -e "{REPO}[{extra}]"'


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
    _one_error_line(proc, f"recipe.{override.split('=')[0]}", f"'{module}'", from_checkout(extra))


def test_validate_names_pyarrow_for_a_parquet_recipe(without, tmp_path):
    (tmp_path / "part.parquet").write_bytes(b"PAR1")
    recipe = {"model": {"family": "gpt2", "size": "tiny"},
              "data": {"kind": "parquet", "paths": ["*.parquet"], "tokenizer": "byte", "seq_len": 32},
              "batch": {"micro_batch_per_rank": 2}, "training": {"max_steps": 2}}
    (tmp_path / "r.json").write_text(json.dumps(recipe))
    without("pyarrow", "torch")
    proc = run_cli("validate", str(tmp_path / "r.json"))
    _one_error_line(proc, "recipe.data.kind 'parquet'", "'pyarrow'", from_checkout("parquet"))


def test_run_without_tensorboard_is_one_line_and_leaves_no_run_dir(without, tmp_path):
    without("tensorboard")
    run_dir = tmp_path / "run"
    proc = run_cli("run", "quickstart", "logging.tensorboard=true", "--run-dir", str(run_dir), timeout=60)
    _one_error_line(proc, "recipe.logging.tensorboard true", from_checkout("dashboards"))
    assert not run_dir.exists()


def test_run_without_matplotlib_trains_and_notes_the_missing_plot(without, tmp_path):
    without("matplotlib")
    run_dir = tmp_path / "run"
    proc = run_cli("run", "quickstart", "training.max_steps=3", "scheduler.warmup_num_steps=1",
                   "training.eval_batches=0", "checkpoint.save_final=false", "--run-dir", str(run_dir), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f'no memory.png: matplotlib is not installed; {from_checkout("dashboards")}' in proc.stdout
    assert (run_dir / "metrics.jsonl").is_file() and not (run_dir / "memory.png").exists()


def test_tutorials_build_names_the_tutorials_extra(without):
    without("jinja2")
    proc = run_cli("tutorials", "build", "--check")
    _one_error_line(proc, "toolkit tutorials build", "'jinja2'", from_checkout("tutorials"))


def test_doctor_lines_say_how_to_install_a_missing_package(without):
    without("wandb")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ["PYTHONPATH"]}
    out = subprocess.run([sys.executable, "-c", "from toolkit.optional_packages import doctor_lines; "
                          "print('\\n'.join(doctor_lines()))"], env=env, capture_output=True, text=True, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("wandb"))
    assert f'missing ({from_checkout("dashboards")})' in line and "recipe.logging.wandb.mode" in line


def test_every_extra_in_the_table_installs_its_package():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for pkg in OPTIONAL_PACKAGES:
        names = [req.split(">")[0].split("=")[0].split("[")[0].strip().lower() for req in extras[pkg.extra]]
        assert pkg.module in names, (pkg.module, pkg.extra, names)


def test_install_origin_follows_how_the_toolkit_was_installed(tmp_path):
    site = tmp_path / "site-packages" / "toolkit"  # an installed copy: no pyproject.toml beside it
    site.mkdir(parents=True)
    (tmp_path / "src").mkdir()
    (tmp_path / "toolkit-0.1.0-py3-none-any.whl").write_bytes(b"PK")
    src, wheel = tmp_path / "src", tmp_path / "toolkit-0.1.0-py3-none-any.whl"
    assert find_install_origin(REPO / "toolkit", None) == InstallOrigin("checkout", str(REPO))
    cases = {  # PEP 610 direct_url.json as pip writes it
        "editable": ({"url": src.as_uri(), "dir_info": {"editable": True}}, InstallOrigin("checkout", str(src))),
        "folder": ({"url": src.as_uri(), "dir_info": {}}, InstallOrigin("path", str(src))),
        "wheel": ({"url": wheel.as_uri(), "archive_info": {}}, InstallOrigin("path", str(wheel))),
        "vcs": ({"url": "https://example.org/toolkit.git", "vcs_info": {"vcs": "git", "commit_id": "abc123"}},
                InstallOrigin("vcs", "git+https://example.org/toolkit.git@abc123")),
        "moved": ({"url": (tmp_path / "gone").as_uri(), "dir_info": {}}, InstallOrigin("unknown")),
        "index": (None, InstallOrigin("unknown")),
    }
    for name, (direct_url, want) in cases.items():
        assert find_install_origin(site, direct_url) == want, name
    assert install_command("parquet", InstallOrigin("checkout", str(src))) == f'pip install -e "{src}[parquet]"'
    assert install_command("parquet", InstallOrigin("path", str(wheel))) == f'pip install "{wheel}[parquet]"'
    assert install_command("parquet", InstallOrigin("vcs", "git+https://example.org/toolkit.git@abc123")) == \
        'pip install "toolkit[parquet] @ git+https://example.org/toolkit.git@abc123"'


def test_without_a_known_source_the_hint_lists_the_extras_requirements():
    hint = install_command("dashboards", InstallOrigin("unknown"))
    assert hint.startswith('pip install "tensorboard>=2.14" "wandb>=0.17" "matplotlib>=3.7" '), hint
    assert "from its source" in hint and "another project" in hint


def test_no_hint_sends_anyone_to_the_index_toolkit():
    origins = [InstallOrigin("checkout", str(REPO)), InstallOrigin("path", "/opt/toolkit"),
               InstallOrigin("vcs", "git+https://example.org/toolkit.git"), InstallOrigin("unknown")]
    for origin in origins:
        for pkg in OPTIONAL_PACKAGES:
            hint = install_command(pkg.extra, origin)  # a VCS URL's `"toolkit[x] @ git+..."` names its source
            assert not re.search(r'"toolkit\[[\w,]+\]"', hint), hint
    docs = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), REPO / "schemas" / "recipe.schema.json",
            *(REPO / "tutorials" / "templates").glob("*.j2")]
    for path in docs:
        assert "toolkit[" not in path.read_text(), path
