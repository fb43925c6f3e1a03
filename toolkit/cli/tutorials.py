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

The output is deterministic, so a stale notebook is a plain byte difference:
cell ids are `<name>-<index>` (`01-quickstart-03`), no outputs, no execution
counts, a fixed python3 kernelspec and nbformat's sorted JSON. No torch here.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from toolkit.errors import UserError

TUTORIALS_DIR = Path(__file__).resolve().parents[2] / "tutorials"
TEMPLATES_DIR = TUTORIALS_DIR / "templates"
TEMPLATE_SUFFIX = ".md.j2"
BUILD_COMMAND = "toolkit tutorials build"

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
_MARKER = re.compile(r"^%%[ \t]*(markdown|code)[ \t]*$")


def _recipe(name: str, *overrides: str):
    """Template helper: `{% set r = recipe("quickstart") %}` then `{{ r.data.vocab_size }}`."""
    from toolkit.recipe.load import load_recipe

    return load_recipe(name, list(overrides))


# NOTE: the whole context every template sees; keep it small so a template
# reads like the notebook it becomes.
TEMPLATE_GLOBALS = {"recipe": _recipe, "ln": math.log}


def notebook_name(template_path: Path) -> str:
    """`01_quickstart.md.j2` -> `01_quickstart`."""
    return Path(template_path).name[: -len(TEMPLATE_SUFFIX)]


def notebook_path(template_path: Path) -> Path:
    """Where a template's notebook is written: `tutorials/<name>.ipynb`."""
    return TUTORIALS_DIR / f"{notebook_name(template_path)}.ipynb"


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


def _render_template_text(template_path: Path) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_path.parent)),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.globals.update(TEMPLATE_GLOBALS)
    try:
        return env.get_template(template_path.name).render(notebook=notebook_name(template_path))
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"{exc.filename or template_path}:{exc.lineno}: template syntax error: {exc.message}") from None
    except jinja2.UndefinedError as exc:
        raise UserError(f"{template_path}: undefined template variable: {exc.message}") from None


def render_notebook(template_path: str | Path) -> str:
    """Render one template to the exact text of its .ipynb (nbformat v4, no outputs, stable ids)."""
    import nbformat

    template_path = Path(template_path)
    name = notebook_name(template_path)
    slug = name.replace("_", "-")
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    for index, (kind, source) in enumerate(split_cells(_render_template_text(template_path), str(template_path))):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = make(source)
        cell.id = f"{slug}-{index:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nbformat.writes(nb, version=4).rstrip("\n") + "\n"


def build_all(check: bool = False) -> list[Path]:
    """Render every template. Build: write the changed notebooks and return every notebook.
    Check (`check=True`): write nothing, return the notebooks that differ from their rendering."""
    built, stale = [], []
    for template in template_paths():
        path = notebook_path(template)
        text = render_notebook(template)
        current = path.read_bytes() if path.is_file() else None
        if current != text.encode("utf-8"):
            stale.append(path)
            if not check:
                path.write_bytes(text.encode("utf-8"))  # bytes: the same "\n" line ends on every OS
        built.append(path)
    return stale if check else built
