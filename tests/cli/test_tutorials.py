"""The tutorial notebooks: committed files match their templates, and each is a
clean, stably-identified notebook. (nbval executes them: `pytest --nbval-lax tutorials`.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from toolkit.errors import UserError
from toolkit.cli.tutorials import (GPU_SUBDIR, KERNELSPEC, TEMPLATES_DIR, TUTORIALS_DIR, build_all, notebook_name, render_notebook,
                               split_cells, template_paths)

NOTEBOOKS = sorted(TUTORIALS_DIR.glob("*.ipynb"))
GPU_NOTEBOOKS = sorted((TUTORIALS_DIR / GPU_SUBDIR).glob("*.ipynb"))


def test_committed_notebooks_match_their_templates():
    stale = build_all(check=True)
    assert not stale, f"stale notebooks {[p.name for p in stale]}: rebuild with `toolkit tutorials build`"


def test_every_notebook_has_a_template_and_every_template_a_notebook():
    templates = {notebook_name(t) for t in template_paths()}
    notebooks = {p.stem for p in NOTEBOOKS}
    assert "01_quickstart" in templates
    assert notebooks == templates


@pytest.mark.parametrize("path", NOTEBOOKS + GPU_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_has_stable_ids_and_python3_kernel(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    slug = path.stem.replace("_", "-")
    assert nb["nbformat"] == 4 and nb["nbformat_minor"] >= 5
    assert nb["metadata"]["kernelspec"] == KERNELSPEC
    assert [cell["id"] for cell in nb["cells"]] == [f"{slug}-{i:02d}" for i in range(len(nb["cells"]))]
    assert [cell for cell in nb["cells"] if cell["cell_type"] == "code"], "a tutorial runs something"
    assert path.read_text(encoding="utf-8").endswith("}\n")


def _outputs(nb: dict, mime: str) -> list[str]:
    return ["".join(out.get("data", {}).get(mime, "")) for cell in nb["cells"] if cell["cell_type"] == "code"
            for out in cell["outputs"]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_shows_its_last_run_a_plot_a_measured_table_and_an_assert(path):
    """What the issue asks of a tutorial: committed with its outputs (`toolkit tutorials build --execute`),
    at least one plot, one table of measured numbers (show_table) and an assert of its claim."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    assert all(cell["execution_count"] is not None for cell in code), "not executed: run `toolkit tutorials build --execute`"
    assert any(not out.get("ename") for cell in code for out in cell["outputs"])
    assert not [out for cell in code for out in cell["outputs"] if out.get("output_type") == "error"]
    assert any(_outputs(nb, "image/png")), "no plot"
    assert any("|---" in text for text in _outputs(nb, "text/markdown")), "no table (show_table)"
    assert any(line.lstrip().startswith("assert ") for cell in code for line in "".join(cell["source"]).splitlines())


def test_every_template_renders_a_gpu_variant():
    assert {p.stem for p in GPU_NOTEBOOKS} == {p.stem for p in NOTEBOOKS}


def test_rendering_twice_gives_identical_bytes():
    for template in template_paths():
        assert render_notebook(template) == render_notebook(template)


def test_split_cells_cuts_at_marker_lines_and_trims_blank_lines():
    text = "\n%% markdown\n# Title\n\n%% code\nx = 1\n%%code\n\ny = 2\n\n"
    assert split_cells(text) == [("markdown", "# Title"), ("code", "x = 1"), ("code", "y = 2")]


def test_split_cells_rejects_text_before_the_first_marker():
    with pytest.raises(UserError, match=r"t\.md\.j2:2: text before the first"):
        split_cells("\nstray\n%% code\nx = 1\n", "t.md.j2")


def test_cli_check_exits_2_naming_the_stale_notebook(tmp_path, monkeypatch):
    import toolkit.cli.tutorials as tutorials
    from toolkit.cli.main import main

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "01_demo.md.j2").write_text("%% markdown\n# {{ notebook }}\n%% code\nprint(1)\n")
    monkeypatch.setattr(tutorials, "TUTORIALS_DIR", tmp_path)
    monkeypatch.setattr(tutorials, "TEMPLATES_DIR", tmp_path / "templates")
    assert main(["tutorials", "build", "--check"]) == 2
    assert not (tmp_path / "01_demo.ipynb").exists() and not (tmp_path / "gpu" / "01_demo.ipynb").exists()
    assert main(["tutorials", "build"]) == 0
    assert main(["tutorials", "build", "--check"]) == 0
    executed = json.loads((tmp_path / "01_demo.ipynb").read_text())
    executed["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
    executed["cells"][1]["execution_count"] = 1
    (tmp_path / "01_demo.ipynb").write_text(json.dumps(executed))
    assert main(["tutorials", "build", "--check"]) == 0  # outputs of a run are not a difference
    (tmp_path / "01_demo.ipynb").write_text("{}\n")
    assert main(["tutorials", "build", "--check"]) == 2


def test_an_executed_notebook_keeps_its_outputs_and_is_not_stale(tmp_path, monkeypatch):
    import toolkit.cli.tutorials as tutorials

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "01_demo.md.j2").write_text("%% code\nprint(6 * 7)\n")
    monkeypatch.setattr(tutorials, "TUTORIALS_DIR", tmp_path)
    monkeypatch.setattr(tutorials, "TEMPLATES_DIR", tmp_path / "templates")
    build_all()
    [(path, _, error)] = tutorials.execute_notebooks([tmp_path / "01_demo.ipynb"], timeout_s=120)
    assert path.name == "01_demo.ipynb" and error is None
    nb = json.loads((tmp_path / "01_demo.ipynb").read_text())
    assert "".join(nb["cells"][0]["outputs"][0]["text"]) == "42\n"
    assert not build_all(check=True)  # the kernel's language_info is not kept: the notebook is as rendered


def test_a_failing_notebook_is_saved_with_its_error_and_fails_the_command(tmp_path, monkeypatch, capsys):
    import toolkit.cli.tutorials as tutorials
    from toolkit.cli.main import main

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "01_demo.md.j2").write_text("%% code\nprint('before')\n%% code\nraise ValueError('boom')\n")
    (tmp_path / "templates" / "02_next.md.j2").write_text("%% code\nprint('after')\n")
    monkeypatch.setattr(tutorials, "TUTORIALS_DIR", tmp_path)
    monkeypatch.setattr(tutorials, "TEMPLATES_DIR", tmp_path / "templates")
    assert main(["tutorials", "build", "--execute"]) == 1
    out = capsys.readouterr().out
    assert "01_demo.ipynb: executed in" in out and "FAILED" in out and "ValueError" in out
    assert "02_next.ipynb: executed in" in out  # the next notebook still ran
    nb = json.loads((tmp_path / "01_demo.ipynb").read_text())
    assert nb["cells"][1]["outputs"][0]["ename"] == "ValueError"
    times = json.loads((tmp_path / "run_times.json").read_text())  # the wall time of the run that succeeded only
    assert set(times["cpu"]) == {"02_next"} and times["gpu"] == {}
    assert 0 < times["cpu"]["02_next"]["seconds"] < 120 and times["cpu"]["02_next"]["cpus"] >= 1


def test_execute_arguments_are_checked_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import toolkit.cli.tutorials as tutorials
    from toolkit.cli.main import main

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "01_demo.md.j2").write_text("%% code\nprint(1)\n")
    monkeypatch.setattr(tutorials, "TUTORIALS_DIR", tmp_path)
    monkeypatch.setattr(tutorials, "TEMPLATES_DIR", tmp_path / "templates")
    assert main(["tutorials", "build", "--execute", "01_dmeo"]) == 2
    assert "no notebook named 01_dmeo" in capsys.readouterr().err
    assert main(["tutorials", "build", "--gpu"]) == 2
    assert "go with --execute" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.ipynb"))


def test_cli_check_stays_free_of_torch():
    code = ("import sys; from toolkit.cli.main import main; rc = main(['tutorials', 'build', '--check']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], cwd=TEMPLATES_DIR.parent.parent, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
