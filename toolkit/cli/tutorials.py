"""Tutorial notebooks from Jinja templates: `tutorials/templates/<name>.md.j2`
renders to `tutorials/<name>.ipynb`, which is committed and executed by nbval.

Template format: Jinja renders the whole file first; the result is then cut
into cells at marker lines, each alone on its line:

    %% markdown
    # A heading
    %% code
    import toolkit

Blank lines around a cell are dropped; nothing but blank lines may come before
the first marker. Files whose name starts with `_` are partials (`{% include %}`,
macros) and render to no notebook.

Each template renders twice: `gpu` false gives tutorials/<name>.ipynb (sizes
that run on 2 CPU cores, executed by nbval in CI), `gpu` true gives
tutorials/gpu/<name>.ipynb (the same story on one GPU of 80 GB or more: at real sizes where one GPU allows, else
with CPU ranks or a CPU-sized model, which its `about` block's "gpu" key says).

The rendering is deterministic: cell ids are `<name>-<index>`
(`01-quickstart-03`), a fixed python3 kernelspec and nbformat's sorted JSON.
Committed notebooks carry the outputs of their last execution (`build
--execute`); a notebook is stale when its cells' sources differ from the
rendering, whatever its outputs. No torch here.

The index, tutorials/README.md, is rendered too: from each template's
`{% set about = {...} %}` block (question, learn, needs, path, and gpu where
the GPU variant does not run at GPU sizes; it renders to no cell) and the
wall times `build --execute` measured (tutorials/run_times.json).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from toolkit.errors import UserError
from toolkit.observe.notebook import markdown_tables  # the notebooks read RESULTS.md tables with it too
from toolkit.resources import checkout_dir

TUTORIALS_DIR = checkout_dir("tutorials")
TEMPLATES_DIR = TUTORIALS_DIR / "templates"
GPU_SUBDIR = "gpu"  # tutorials/gpu/: the GPU variants
TEMPLATE_SUFFIX = ".md.j2"
BUILD_COMMAND = "toolkit tutorials build"

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
_MARKER = re.compile(r"^%%[ \t]*(markdown|code)[ \t]*$")


def _recipe(name: str, *overrides: str):
    """Template helper: `{% set r = recipe("quickstart") %}` then `{{ r.data.vocab_size }}`."""
    from toolkit.recipe.load import load_recipe

    return load_recipe(name, list(overrides))


class ResultsSection:
    """One `## ` section of benchmarks/RESULTS.md, so that a template quotes its figures instead of typing them."""

    def __init__(self, title: str, text: str):
        self.title = title
        first_paragraph = text.strip().split("\n\n", 1)[0]
        self.date = re.search(r"\d{4}-\d{2}-\d{2}", first_paragraph).group(0)  # of the run, on the provenance line
        self.command = " ".join(re.search(r"`([^`]+)`", first_paragraph).group(1).split())
        self.peers = [" ".join(p.split())[len("Peer: "):] for p in text.split("\n\n") if p.startswith("Peer: ")]
        self.tables = markdown_tables(text)

    def row(self, table: int, first_cell: str) -> dict[str, str]:
        """The row of `tables[table]` whose first cell is `first_cell`, else the one row whose first cell starts
        with it."""
        rows = self.tables[table]
        key = next(iter(rows[0]))
        exact = [row for row in rows if row[key] == first_cell]
        prefixed = [row for row in rows if row[key].startswith(first_cell)]
        if exact or len(prefixed) == 1:
            return (exact or prefixed)[0]
        raise UserError(f"benchmarks/RESULTS.md, {self.title!r}, table {table}: no single row {first_cell!r}")


def _results(title: str) -> ResultsSection:
    """Template helper: `{% set z = results("ZeRO on one H200") %}` then `{{ z.row(1, "stage2")["tokens/s"] }}`,
    `{{ z.date }}`, `{{ z.command }}`: the section of benchmarks/RESULTS.md whose heading starts with `title`."""
    from toolkit.resources import results_path

    sections = results_path().read_text(encoding="utf-8").split("\n## ")[1:]
    found = [s for s in sections if s.startswith(title)]
    if len(found) != 1:
        raise UserError(f"{results_path()}: {len(found)} sections titled {title!r}..., expected one")
    heading, body = found[0].split("\n", 1)
    return ResultsSection(heading, body)


# NOTE: the whole context every template sees; keep it small so a template
# reads like the notebook it becomes.
TEMPLATE_GLOBALS = {"recipe": _recipe, "results": _results, "ln": math.log}


def notebook_name(template_path: Path) -> str:
    """`01_quickstart.md.j2` -> `01_quickstart`."""
    return Path(template_path).name[: -len(TEMPLATE_SUFFIX)]


def notebook_path(template_path: Path, gpu: bool = False) -> Path:
    """Where a template's notebook is written: `tutorials/<name>.ipynb`, or `tutorials/gpu/<name>.ipynb`."""
    return (TUTORIALS_DIR / GPU_SUBDIR if gpu else TUTORIALS_DIR) / f"{notebook_name(template_path)}.ipynb"


def template_paths() -> list[Path]:
    """Every notebook template (partials starting with `_` excluded), in name order."""
    if not TEMPLATES_DIR.is_dir():
        raise UserError(f"{TEMPLATES_DIR}: no tutorial templates here (the tutorials live in a source checkout)")
    return sorted(p for p in TEMPLATES_DIR.glob(f"*{TEMPLATE_SUFFIX}") if not p.name.startswith("_"))


def split_cells(text: str, source: str = "<template>") -> list[tuple[str, str]]:
    """Rendered template text -> [(cell_type, source)], cut at `%% markdown` / `%% code` lines."""
    cells: list[tuple[str, list[str]]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        marker = _MARKER.match(line)
        if marker:
            cells.append((marker.group(1), []))
        elif cells:
            cells[-1][1].append(line)
        elif line.strip():
            raise UserError(f"{source}:{lineno}: text before the first `%% markdown` or `%% code` line")
    if not cells:
        raise UserError(f"{source}: no cells (start each cell with a `%% markdown` or `%% code` line)")
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in cells]


def _render_template_text(template_path: Path, gpu: bool = False, module: bool = False):
    """The rendered text; `module=True`: the rendered template as a module, whose attributes are its top-level
    `{% set %}` names (`about`)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_path.parent)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.globals.update(TEMPLATE_GLOBALS)
    try:
        template, context = env.get_template(template_path.name), {"notebook": notebook_name(template_path), "gpu": gpu}
        return template.make_module(context) if module else template.render(context)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"{exc.filename or template_path}:{exc.lineno}: template syntax error: {exc.message}") from None
    except jinja2.UndefinedError as exc:
        raise UserError(f"{template_path}: undefined template variable: {exc.message}") from None


def render_notebook(template_path: str | Path, gpu: bool = False) -> str:
    """Render one template (its CPU or GPU variant) to the exact text of its .ipynb (nbformat v4, no outputs,
    stable ids)."""
    import nbformat

    template_path = Path(template_path)
    name = notebook_name(template_path)
    slug = name.replace("_", "-")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    for index, (kind, source) in enumerate(split_cells(_render_template_text(template_path, gpu), str(template_path))):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(source)
        cell.id = f"{slug}-{index:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nbformat.writes(nb, version=4).rstrip("\n") + "\n"


def _without_outputs(text: str) -> str:
    """A notebook's text with every code cell's outputs and execution count cleared (what a template renders)."""
    import nbformat

    nb = nbformat.reads(text, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.metadata = {}
    return nbformat.writes(nb, version=4).rstrip("\n") + "\n"


def _keep_executed_prefix(path: Path, text: str) -> str:
    """`text` (a fresh rendering) with the outputs of `path`'s code cells kept while the code is unchanged: every
    code cell up to the first whose source differs from the old notebook's cell at the same position (markdown may
    change freely). Outputs after a changed code cell are dropped: they may no longer follow from the code.

    NOTE: so a GPU variant, which only a GPU machine can execute, keeps its executed part when a template gains a
    closing section or new prose, rather than losing every output until the next GPU run.
    """
    import nbformat

    try:
        old = [c for c in nbformat.reads(path.read_text(encoding="utf-8"), as_version=4).cells if c.cell_type == "code"]
    except Exception:  # missing or not a notebook: nothing to keep
        return text
    nb = nbformat.reads(text, as_version=4)
    for new, before in zip([c for c in nb.cells if c.cell_type == "code"], old):
        if new.source != before.source:
            break
        new.outputs, new.execution_count = before.outputs, before.execution_count
    return nbformat.writes(nb, version=4).rstrip("\n") + "\n"


def _same_cells(path: Path, text: str) -> bool:
    """True when the notebook at `path` has exactly the cells `text` renders (outputs aside)."""
    try:
        return _without_outputs(path.read_text(encoding="utf-8")) == text
    except Exception:  # missing, or not a notebook (hand-edited, truncated): stale, rebuilt from its template
        return False


PATHS = {  # learning path -> what it covers; each template's `about.path` names one
    "basics": "train, check, save and generate; real text",
    "memory": "where the bytes of a step go, and the keys that move them",
    "scale": "speed and several ranks: kernels, tuning, communication, parallelism",
}
ABOUT_KEYS = {"question": str, "learn": str, "needs": list, "path": str, "gpu": str}  # gpu: optional
INDEX_NAME = "README.md"


def read_about(template_path: Path) -> dict:
    """A template's `about` block, checked: the question it answers, what you learn, the notebooks it needs, its
    learning path, and (optional) what its GPU variant runs where that is not the GPU."""
    about = getattr(_render_template_text(template_path, module=True), "about", None)
    where = f"{template_path}: `{{% set about = {{...}} %}}`"
    if not isinstance(about, dict):
        raise UserError(f"{template_path}: no `{{% set about = {{...}} %}}` block (the tutorials index is built from it)")
    missing = sorted(set(ABOUT_KEYS) - {"gpu"} - set(about))
    unknown = sorted(set(about) - set(ABOUT_KEYS))
    wrong = sorted(k for k, v in about.items() if k in ABOUT_KEYS and not isinstance(v, ABOUT_KEYS[k]))
    if missing or unknown or wrong:
        raise UserError(f"{where}: missing {missing}, unknown {unknown}, wrong type {wrong}")
    if about["path"] not in PATHS:
        raise UserError(f"{where}: path {about['path']!r} is not one of {sorted(PATHS)}")
    return about


def _title(template_path: Path) -> str:
    """The notebook's `# ` heading (its CPU variant's)."""
    text = _render_template_text(template_path)
    return next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), notebook_name(template_path))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def _gpu_run_time(name: str, times: dict) -> str:
    if name in times:
        t = times[name]
        card = f" on one {t['device']}" if t.get("device") else ""
        return f"{_duration(t['seconds'])}{card} ({t['date']})"
    import json

    notebook = TUTORIALS_DIR / GPU_SUBDIR / f"{name}.ipynb"
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"] if notebook.is_file() else []
    return "not measured" if any(cell.get("execution_count") for cell in cells) else "not yet executed"


def render_index() -> str:
    """tutorials/README.md: the learning paths, then per notebook its question, what you learn, what you need,
    the measured run times and both variants' links."""
    templates = template_paths()
    names = [notebook_name(t) for t in templates]
    abouts = {notebook_name(t): read_about(t) for t in templates}
    titles = {notebook_name(t): _title(t) for t in templates}
    for name, about in abouts.items():
        unknown = [n for n in about["needs"] if n not in names]
        if unknown:
            raise UserError(f"{TEMPLATES_DIR / (name + TEMPLATE_SUFFIX)}: about.needs names no notebook: {unknown}")
    times = read_run_times()

    def link(name: str) -> str:
        return f"[{name[:2]} {titles[name].split(':')[0]}]({name}.ipynb)"

    lines = ["# Tutorials", "",
             f"<!-- Generated by `{BUILD_COMMAND}` from the `about` block at the top of each",
             "     tutorials/templates/*.md.j2 and from run_times.json; edit those, not this file. -->", "",
             "Each notebook answers one question with runs it measures itself and asserts what it concludes.",
             "`NN_name.ipynb` is the CPU variant: sized for 2 CPU cores, committed with its outputs and executed by",
             "the tests (nbval). `gpu/NN_name.ipynb` is the GPU variant, sized for one NVIDIA GPU of 80 GB or more",
             "and committed with the outputs of its last run on the GPU machine lent to us (an H100 or an H200: each",
             "entry's run time names the card); where it runs CPU ranks or a CPU-sized model, its entry says so.", "",
             "Open the first one from a fresh clone (the `tutorials` extra brings Jupyter):", "",
             "```bash",
             'pip install torch==2.13.0 && pip install ".[tutorials]" && jupyter lab tutorials/01_quickstart.ipynb',
             "```", "",
             "## Learning paths", ""]
    for path, covers in PATHS.items():
        members = [n for n in names if abouts[n]["path"] == path]
        lines.append(f"- **{path}** ({covers}): " + " → ".join(link(n) for n in members))
    lines += ["", "Run times: wall time of the last `toolkit tutorials build --execute` of each variant "
              "(tutorials/run_times.json); the CPU ones on a 2-core VM shared with other work.", "",
              "## The notebooks", ""]
    for name in names:
        about, cpu = abouts[name], times["cpu"].get(name)
        cpu_time = f"{_duration(cpu['seconds'])} on {cpu['cpus']} CPU cores ({cpu['date']})" if cpu else "not measured"
        needs = ", ".join(link(n) for n in about["needs"]) or "nothing: start here"
        lines += [f"### {name[:2]}. {titles[name]}", "",
                  f"[CPU variant]({name}.ipynb) · [GPU variant]({GPU_SUBDIR}/{name}.ipynb)", "",
                  f"- **Question:** {about['question']}",
                  f"- **You will learn to** {about['learn']}.",
                  f"- **You need:** {needs}.",
                  f"- **Run time:** CPU {cpu_time}; GPU {_gpu_run_time(name, times['gpu'])}."]
        if "gpu" in about:
            lines.append(f"- **The GPU variant runs** {about['gpu']}.")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def index_path() -> Path:
    """tutorials/README.md, the generated index."""
    return TUTORIALS_DIR / INDEX_NAME


def build_index(check: bool = False) -> bool:
    """Render the index; write it unless `check`. True when the committed index differed from the rendering."""
    text, path = render_index(), index_path()
    stale = not path.is_file() or path.read_text(encoding="utf-8") != text
    if stale and not check:
        path.write_bytes(text.encode("utf-8"))
    return stale


def _variants():
    for template in template_paths():
        for gpu in (False, True):
            yield template, gpu, notebook_path(template, gpu)


def build_all(check: bool = False) -> list[Path]:
    """Render every template, CPU and GPU variant, and the index. Build: write the notebooks whose cells changed
    (outputs kept up to the first changed code cell, `_keep_executed_prefix`; the rest are gone until the next
    `--execute`) and the index if it changed, and return them all.
    Check (`check=True`): write nothing, return those that differ from their rendering."""
    built, stale = [], []
    for template, gpu, path in _variants():
        text = render_notebook(template, gpu)
        if not _same_cells(path, text):
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                kept = _keep_executed_prefix(path, text)
                path.write_bytes(kept.encode("utf-8"))  # bytes: the same "\n" line ends on every OS
        built.append(path)
    if build_index(check):
        stale.append(index_path())
    built.append(index_path())
    return stale if check else built


def run_times_path() -> Path:
    """tutorials/run_times.json: each notebook's last successful `build --execute` wall time, CPU and GPU variants."""
    return TUTORIALS_DIR / "run_times.json"


def read_run_times() -> dict:
    """{"cpu": {name: {"seconds", "date", "cpus"}}, "gpu": {...}}; empty variants when nothing was recorded."""
    import json

    path = run_times_path()
    times = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return {"cpu": times.get("cpu", {}), "gpu": times.get("gpu", {})}


def _gpu_name() -> str | None:
    """The first CUDA device's name, or None without one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def record_run_time(notebook: Path, seconds: float) -> None:
    """Write one executed notebook's wall time into run_times.json (measured by `execute_notebooks`, never typed)."""
    import datetime
    import json
    import os

    times = read_run_times()
    variant = "gpu" if notebook.parent.name == GPU_SUBDIR else "cpu"
    entry = {"seconds": round(seconds, 1), "date": datetime.date.today().isoformat(), "cpus": os.cpu_count()}
    card = _gpu_name() if variant == "gpu" else None  # the gallery's card: the device lends an H100 or an H200
    if card:
        entry["device"] = card
    times[variant][notebook.stem] = entry
    times = {v: dict(sorted(times[v].items())) for v in ("cpu", "gpu")}
    run_times_path().write_bytes((json.dumps(times, indent=1) + "\n").encode("utf-8"))
