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
tutorials/gpu/<name>.ipynb (the same story at real sizes, executed on a GPU).

The rendering is deterministic: cell ids are `<name>-<index>`
(`01-quickstart-03`), a fixed python3 kernelspec and nbformat's sorted JSON.
Committed notebooks carry the outputs of their last execution (`build
--execute`); a notebook is stale when its cells' sources differ from the
rendering, whatever its outputs. No torch here.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from toolkit.errors import UserError
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


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text`, each a list of {column: cell} rows."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith(("|---", "| ---")) and (i == 0 or not lines[i - 1].startswith("|")):
            header = [c.strip() for c in line.strip().strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip().strip("|").split("|")))))
            tables.append(rows)
    return tables


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


def _render_template_text(template_path: Path, gpu: bool = False) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_path.parent)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.globals.update(TEMPLATE_GLOBALS)
    try:
        return env.get_template(template_path.name).render(notebook=notebook_name(template_path), gpu=gpu)
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


def _same_cells(path: Path, text: str) -> bool:
    """True when the notebook at `path` has exactly the cells `text` renders (outputs aside)."""
    try:
        return _without_outputs(path.read_text(encoding="utf-8")) == text
    except Exception:  # missing, or not a notebook (hand-edited, truncated): stale, rebuilt from its template
        return False


def _variants():
    for template in template_paths():
        for gpu in (False, True):
            yield template, gpu, notebook_path(template, gpu)


def build_all(check: bool = False) -> list[Path]:
    """Render every template, CPU and GPU variant. Build: write the notebooks whose cells changed (their outputs
    are then gone until the next `--execute`) and return every notebook. Check (`check=True`): write nothing,
    return the notebooks whose cells differ from their rendering."""
    built, stale = [], []
    for template, gpu, path in _variants():
        text = render_notebook(template, gpu)
        if not _same_cells(path, text):
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(text.encode("utf-8"))  # bytes: the same "\n" line ends on every OS
        built.append(path)
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


def record_run_time(notebook: Path, seconds: float) -> None:
    """Write one executed notebook's wall time into run_times.json (measured by `execute_notebooks`, never typed)."""
    import datetime
    import json
    import os

    times = read_run_times()
    variant = "gpu" if notebook.parent.name == GPU_SUBDIR else "cpu"
    times[variant][notebook.stem] = {"seconds": round(seconds, 1), "date": datetime.date.today().isoformat(),
                                     "cpus": os.cpu_count()}
    times = {v: dict(sorted(times[v].items())) for v in ("cpu", "gpu")}
    run_times_path().write_bytes((json.dumps(times, indent=1) + "\n").encode("utf-8"))


def execute_notebooks(paths: list[Path], timeout_s: int = 900):
    """Run each notebook top to bottom in a fresh python3 kernel (its folder as the working directory, this
    checkout first on PYTHONPATH) and write it back with its outputs, a failing one too (its error shows where);
    yields (path, seconds, the error's first line or None) as each one is written."""
    import os
    import time

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    root = str(TUTORIALS_DIR.parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, old) if p)
    try:
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            rendered_metadata = dict(nb.metadata)
            start, error = time.perf_counter(), None
            # NOTE: no per-cell timing metadata: an executed notebook differs from the last only in its outputs.
            client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", record_timing=False,
                                    resources={"metadata": {"path": str(path.parent)}})
            try:
                client.execute()
            except CellExecutionError as exc:
                error = f"{exc.ename}: {exc.evalue}".splitlines()[0][:300]
            nb.metadata = rendered_metadata  # the kernel's language_info (its Python version) would make it stale
            path.write_bytes((nbformat.writes(nb, version=4).rstrip("\n") + "\n").encode("utf-8"))
            # NOTE: one by one, so that a run cut short (a device call's time limit) keeps what it finished.
            yield path, time.perf_counter() - start, error
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
