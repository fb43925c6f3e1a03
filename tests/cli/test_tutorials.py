"""The tutorial notebooks: committed files match their templates, and each is a
clean, stably-identified notebook. (nbval executes them: `pytest --nbval-lax tutorials`.)"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from toolkit.errors import UserError
from toolkit.cli.tutorials import (GPU_SUBDIR, KERNELSPEC, PATHS, TEMPLATES_DIR, TUTORIALS_DIR, build_all, notebook_name,
                                   read_about, read_run_times, render_notebook, split_cells, template_paths)

NOTEBOOKS = sorted(TUTORIALS_DIR.glob("*.ipynb"))
GPU_NOTEBOOKS = sorted((TUTORIALS_DIR / GPU_SUBDIR).glob("*.ipynb"))
# The front matter every template carries (the index is built from it); the throwaway templates below use this one.
ABOUT = '{% set about = {"question": "Q?", "learn": "do it", "needs": [], "path": "basics"} %}\n'

# Code cells that may have no outputs, with why; a notebook's path (relative to tutorials/) stands for all its cells.
# A cell id stands for that cell in both variants.
NO_OUTPUT = {
    "01-quickstart-10": "removes the notebook's temporary run directory; prints nothing",
    "02-zero-memory-09": "removes the notebook's temporary run directory; prints nothing",
    "03-workflow-01": "the parameters cell: assignments only",
    "04-precision-15": "defines DeepSpeed's loss-scale rule, transcribed; prints nothing (GPU variant)",
    "04-precision-25": "removes the notebook's temporary run directory; prints nothing (GPU variant)",
    "04-precision-17": "defines DeepSpeed's loss-scale rule, transcribed; prints nothing (CPU variant: its bf16 "
                       "speed section comes first)",
    "04-precision-27": "removes the notebook's temporary run directory; prints nothing (CPU variant)",
    "07-zero-offload-19": "defines the sweep's timing function; prints nothing",
    "07-zero-offload-29": "removes the notebook's temporary run directory; prints nothing",
    "09-real-data-21": "removes the notebook's temporary cache directory; prints nothing",
    "11-zero-infinity-05": "defines the step loop and the per-tier byte count; prints nothing",
    "11-zero-infinity-14": "removes the notebook's temporary swap directory; prints nothing",
    "14-parallelism-05": "defines each rank's clocked step loop; prints nothing",
    "14-parallelism-18": "removes the ranks' temporary output directory; prints nothing",
    "18-offload-overlap-01": "imports and the parameters: assignments only",
    "18-offload-overlap-10": "trains the clipped runs: assignments only (the next cell prints what they did)",
    "03-workflow-29": "removes the notebook's temporary directory; prints nothing",
    "13-communication-19": "removes the ranks' temporary output directory; prints nothing",
    "17-convert-export-resume-11": "removes the notebook's temporary directory; prints nothing",
}


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
    (tmp_path / "templates" / "01_demo.md.j2").write_text(ABOUT + "%% markdown\n# {{ notebook }}\n%% code\nprint(1)\n")
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
    import toolkit.cli.notebook_runner as notebook_runner
    import toolkit.cli.tutorials as tutorials

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "01_demo.md.j2").write_text(ABOUT + "%% code\nprint(6 * 7)\n")
    monkeypatch.setattr(tutorials, "TUTORIALS_DIR", tmp_path)
    monkeypatch.setattr(tutorials, "TEMPLATES_DIR", tmp_path / "templates")
    build_all()
    [(path, _, error)] = notebook_runner.execute_notebooks([tmp_path / "01_demo.ipynb"], timeout_s=120)
    assert path.name == "01_demo.ipynb" and error is None
    nb = json.loads((tmp_path / "01_demo.ipynb").read_text())
    assert "".join(nb["cells"][0]["outputs"][0]["text"]) == "42\n"
    assert not build_all(check=True)  # the kernel's language_info is not kept: the notebook is as rendered


def test_a_rebuild_keeps_outputs_up_to_the_first_changed_code_cell(tmp_path, monkeypatch):
    import toolkit.cli.notebook_runner as notebook_runner
    import toolkit.cli.tutorials as tutorials

    (tmp_path / "templates").mkdir()
    template = tmp_path / "templates" / "01_demo.md.j2"
    template.write_text(ABOUT + "%% code\nprint(1)\n%% code\nprint(2)\n%% code\nprint(3)\n")
    monkeypatch.setattr(tutorials, "TUTORIALS_DIR", tmp_path)
    monkeypatch.setattr(tutorials, "TEMPLATES_DIR", tmp_path / "templates")
    build_all()
    list(notebook_runner.execute_notebooks([tmp_path / "01_demo.ipynb"], timeout_s=120))

    def outputs():
        cells = json.loads((tmp_path / "01_demo.ipynb").read_text())["cells"]
        return ["".join("".join(o["text"]) for o in c["outputs"]) if c["cell_type"] == "code" else "md" for c in cells]

    assert outputs() == ["1\n", "2\n", "3\n"]
    template.write_text(ABOUT + "%% markdown\nNew prose.\n%% code\nprint(1)\n%% code\nprint(2)\n%% code\nprint(3)\n"
                        "%% code\nprint(4)\n")
    build_all()
    assert outputs() == ["md", "1\n", "2\n", "3\n", ""]  # prose and an appended cell keep what ran
    template.write_text(ABOUT + "%% code\nprint(1)\n%% code\nprint(20)\n%% code\nprint(3)\n")
    build_all()
    assert outputs() == ["1\n", "", ""]  # from the changed cell on, outputs may no longer follow from the code
    assert not build_all(check=True)


def test_a_failing_notebook_is_saved_with_its_error_and_fails_the_command(tmp_path, monkeypatch, capsys):
    import toolkit.cli.tutorials as tutorials
    from toolkit.cli.main import main

    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "01_demo.md.j2").write_text(ABOUT + "%% code\nprint('before')\n%% code\nraise ValueError('boom')\n")
    (tmp_path / "templates" / "02_next.md.j2").write_text(ABOUT + "%% code\nprint('after')\n")
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
    (tmp_path / "templates" / "01_demo.md.j2").write_text(ABOUT + "%% code\nprint(1)\n")
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


def _relative(path) -> str:
    return path.relative_to(TUTORIALS_DIR).as_posix()


@pytest.mark.parametrize("path", NOTEBOOKS + GPU_NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_code_cell_has_outputs_or_a_listed_reason_and_no_output_is_an_error(path):
    """Issue 34 item 2: every committed notebook, CPU and GPU, shows its last run."""
    code = [cell for cell in json.loads(path.read_text(encoding="utf-8"))["cells"] if cell["cell_type"] == "code"]
    errors = [(cell["id"], out.get("ename")) for cell in code for out in cell["outputs"] if out["output_type"] == "error"]
    assert not errors, f"{_relative(path)}: error outputs {errors}"
    if _relative(path) in NO_OUTPUT:
        return
    silent = [cell["id"] for cell in code if not cell["outputs"] and cell["id"] not in NO_OUTPUT]
    assert not silent, (f"{_relative(path)}: code cells without outputs {silent}: execute it "
                        f"(`toolkit tutorials build --execute`) or list them in NO_OUTPUT with the reason")


def test_the_no_output_list_has_no_stale_entry():
    notebooks = {_relative(p): json.loads(p.read_text(encoding="utf-8")) for p in NOTEBOOKS + GPU_NOTEBOOKS}
    code = {name: [c for c in nb["cells"] if c["cell_type"] == "code"] for name, nb in notebooks.items()}
    silent_cells = {c["id"] for cells in code.values() for c in cells if not c["outputs"]}
    # a whole notebook may be listed while any of its code cells is silent (a GPU variant executed in part)
    silent_notebooks = {name for name, cells in code.items() if not all(c["outputs"] for c in cells)}
    stale = sorted(set(NO_OUTPUT) - silent_cells - silent_notebooks)
    assert not stale, f"NO_OUTPUT lists {stale}, which now have outputs (or no longer exist): remove them"
    assert all(len(reason.split()) >= 3 for reason in NO_OUTPUT.values())


INDEX = TUTORIALS_DIR / "README.md"


def _index_entry(name: str) -> str:
    return INDEX.read_text(encoding="utf-8").split(f"\n### {name[:2]}. ", 1)[1].split("\n### ", 1)[0]


def test_the_index_links_resolve():
    links = re.findall(r"\]\(([^)]+)\)", INDEX.read_text(encoding="utf-8"))
    assert len(links) >= 2 * len(NOTEBOOKS)
    assert not [link for link in links if not (TUTORIALS_DIR / link).is_file()]


def test_the_index_gives_each_notebook_both_variants_and_its_measured_cpu_time():
    times = read_run_times()
    for path in NOTEBOOKS:
        entry = _index_entry(path.stem)
        assert f"[CPU variant]({path.name}) · [GPU variant](gpu/{path.name})" in entry
        assert ("CPU not measured" in entry) == (path.stem not in times["cpu"]), entry
        if path.stem in times["cpu"]:
            assert f"on {times['cpu'][path.stem]['cpus']} CPU cores ({times['cpu'][path.stem]['date']})" in entry
        executed = any(c.get("execution_count") for c in json.loads(
            (TUTORIALS_DIR / GPU_SUBDIR / path.name).read_text(encoding="utf-8"))["cells"])
        assert ("GPU not yet executed" in entry) == (not executed and path.stem not in times["gpu"]), entry


def test_the_index_says_which_gpu_variants_run_on_cpu_ranks_or_cpu_sized_models():
    """Issue 34: 02 runs one rank, 13 and 14 gloo ranks on CPU cores, 09 a CPU-sized recipe, 17 the CPU run."""
    says = {notebook_name(t) for t in template_paths() if "gpu" in read_about(t)}
    assert says == {"02_zero_memory", "09_real_data", "13_communication", "14_parallelism", "17_convert_export_resume"}
    for name in says:
        assert "- **The GPU variant runs** " in _index_entry(name)


def test_every_notebook_is_on_a_learning_path_and_needs_only_earlier_notebooks():
    for template in template_paths():
        about, name = read_about(template), notebook_name(template)
        assert about["path"] in PATHS
        assert all(need < name for need in about["needs"]), (name, about["needs"])
        assert f"({name}.ipynb)" in INDEX.read_text(encoding="utf-8").split("## Learning paths", 1)[1].split("\n## ")[0]


def test_a_template_without_about_or_with_an_unknown_path_fails_the_build(tmp_path, monkeypatch, capsys):
    import toolkit.cli.tutorials as tutorials
    from toolkit.cli.main import main

    (tmp_path / "templates").mkdir()
    template = tmp_path / "templates" / "01_demo.md.j2"
    monkeypatch.setattr(tutorials, "TUTORIALS_DIR", tmp_path)
    monkeypatch.setattr(tutorials, "TEMPLATES_DIR", tmp_path / "templates")
    template.write_text("%% code\nprint(1)\n")
    assert main(["tutorials", "build"]) == 2
    assert "01_demo.md.j2: no `{% set about = {...} %}` block" in capsys.readouterr().err
    template.write_text(ABOUT.replace('"basics"', '"advanced"') + "%% code\nprint(1)\n")
    assert main(["tutorials", "build"]) == 2
    assert "path 'advanced' is not one of ['basics', 'memory', 'scale']" in capsys.readouterr().err
    template.write_text(ABOUT + "%% code\nprint(1)\n")
    assert main(["tutorials", "build"]) == 0
    index = (tmp_path / "README.md").read_text()
    assert "### 01. 01_demo" in index and "CPU not measured; GPU not yet executed." in index
    assert main(["tutorials", "build", "--check"]) == 0


def test_the_readme_learn_line_opens_the_first_notebook_after_the_test_command_which_installs_jupyter():
    import tomllib

    root = TUTORIALS_DIR.parent
    setup = (root / "README.md").read_text(encoding="utf-8").split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert setup.count("```bash") == 2  # the README keeps exactly two set-up commands
    test_extra = re.search(r'pip install -e "\.\[(\w+)\]" && python -m pytest', setup).group(1)
    notebook = re.search(r"Learn: .*?`jupyter lab (\S+)`", setup, re.S).group(1)
    assert notebook == "tutorials/01_quickstart.ipynb" and (root / notebook).is_file()
    extras = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    brought = {extra for requirement in extras[test_extra] if requirement.startswith("toolkit[")
               for extra in requirement[len("toolkit["):-1].split(",")}
    assert any(r.startswith("jupyter") for extra in brought | {test_extra} for r in extras[extra]), brought


def test_results_quotes_a_section_of_results_md_and_names_what_it_cannot_find():
    from toolkit.cli.tutorials import TEMPLATE_GLOBALS
    from toolkit.resources import results_path

    results = TEMPLATE_GLOBALS["results"]
    zero = results("ZeRO on one H200")
    text = results_path().read_text(encoding="utf-8")
    stage2 = zero.row(1, "stage2")  # exact first cell, though "stage2-offload" starts with it too
    assert stage2["config"] == "stage2" and f"| stage2 | {stage2['params']} | {stage2['tokens/s']} |" in text
    assert zero.row(0, "stage2-off")["config"] == "stage2-offload"  # a unique prefix
    assert zero.date in text.split("## ZeRO on one H200", 1)[1].split("\n\n", 2)[1]  # from the provenance line
    with pytest.raises(UserError, match="no single row 'stage'"):
        zero.row(1, "stage")
    with pytest.raises(UserError, match="0 sections titled 'No such benchmark'"):
        results("No such benchmark")


# Issue 34 item 5, the step-through form. Templates another engineer converts on their own branch, until merged;
# each is an expected failure (strict: once it passes, its entry must go, so the set shrinks to empty).
NOT_YET_STEP_THROUGH = {
}
CODE_CELL_LINES, INTRO_WORDS = 40, 150
ABOUT_BOX = ("> **You will learn to** ", "> **You need:** ")  # tutorials/templates/_about_box.md.j2


def _step_through_params():
    return [pytest.param(p, id=f"{p.parent.name}/{p.name}",
                         marks=[pytest.mark.xfail(strict=True, reason=NOT_YET_STEP_THROUGH[p.stem])]
                         if p.stem in NOT_YET_STEP_THROUGH else [])
            for p in NOTEBOOKS + GPU_NOTEBOOKS]


def intro_words(cells: list[dict]) -> int:
    """The intro's length: whitespace-separated words of every markdown cell before the first code cell, the
    "You will learn / You need" box's lines left out (they repeat the `about` block)."""
    intro = []
    for cell in cells:
        if cell["cell_type"] == "code":
            break
        intro += [line for line in "".join(cell["source"]).splitlines() if not line.startswith(ABOUT_BOX)]
    return len(" ".join(intro).split())


@pytest.mark.parametrize("path", _step_through_params())
def test_every_notebook_steps_through_short_cells_a_short_intro_a_try_it_cell_and_next_links(path):
    """Issue 34 item 5: code cells of at most 40 lines, an intro under 150 words closed by the learn/need box, a
    "Try it" code cell that asks for a prediction first, and a closing "Next" cell whose links resolve."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    sources = [(cell["cell_type"], "".join(cell["source"])) for cell in cells]
    long = {cell["id"]: n for cell, (kind, src) in zip(cells, sources)
            if kind == "code" and (n := len(src.splitlines())) > CODE_CELL_LINES}
    assert not long, f"code cells over {CODE_CELL_LINES} lines (split them along the story): {long}"
    assert intro_words(cells) <= INTRO_WORDS, f"intro of {intro_words(cells)} words"
    intro = "".join(src for kind, src in sources[:next(i for i, (k, _) in enumerate(sources) if k == "code")])
    assert all(line in intro for line in ABOUT_BOX), "no learn/need box (include _about_box.md.j2)"
    try_it = [src for kind, src in sources if kind == "code" and src.startswith("# Try it:")]
    assert try_it and "predict" in try_it[0].splitlines()[0].lower(), "no `# Try it: ... predict ...` code cell"
    kind, last = sources[-1]
    assert kind == "markdown" and last.startswith("## Next"), "the notebook does not end with its Next links"
    links = re.findall(r"\]\(([^)#]+\.ipynb)\)", last)
    assert links and all((path.parent / link).is_file() for link in links), links
