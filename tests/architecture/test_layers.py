"""The package's folders are its layers: each imports only the layers below it, and of those only what its
__init__ docstring's "May import:" names; no modules import each other in a loop. Read from the source
(every import statement, lazy ones inside functions too)."""
import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "toolkit"
# Bottom to top. A module may import its own layer's package (its siblings) and any lower layer; layers that
# share a rank are peers and may not import each other.
LAYERS = {
    "ground": 0,      # toolkit.errors, .resources, .specs, .optional_packages, .regular_files, .distributed
    "data": 1, "models": 1, "ops": 1,
    "recipe": 2,
    "observe": 3, "checkpoint": 3,
    "runtime": 4,
    "train": 5,
    "cli": 6,
}
FACE = {"toolkit", "toolkit.__main__"}  # the public face: imports what it hands on; only the CLI reads it (version)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "ground"


def toolkit_imports(path: Path) -> set[str]:
    """Every toolkit module `path` imports (a `from pkg import name` counts `pkg.name` when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "toolkit")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "toolkit":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_package_is_a_known_layer():
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")} - {"toolkit"}
    top = {name.split(".")[1] for name in packages}
    assert top <= set(LAYERS), f"a package with no layer: {sorted(top - set(LAYERS))}"


def test_no_import_runs_back_up_a_layer():
    back = []
    for name, path in MODULES.items():
        if name in FACE:
            continue
        mine = layer_of(name)
        for target in toolkit_imports(path):
            theirs = layer_of(target)
            if (target in FACE and mine != "cli") or (theirs != mine and LAYERS[theirs] >= LAYERS[mine]):
                back.append(f"{name} ({mine}) imports {target} ({theirs})")
    assert not back, "\n".join(back)


def declared_imports(layer: str) -> set[str] | None:
    """The layers `layer`'s package docstring says it may import (its "May import:" paragraph); None where it
    says every layer (below it), which the rank order above already holds it to."""
    doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text(encoding="utf-8"))) or ""
    assert "May import:" in doc, f"toolkit/{layer}/__init__.py: its docstring does not say what it may import"
    said = " ".join(doc.split("May import:", 1)[1].split())
    if "every layer" in said or "everything below" in said:
        return None
    named = {layer_of(f"toolkit.{name}") for name in re.findall(r"toolkit\.(\w+)", said)}
    return named | ({"ground"} if "ground floor" in said else set())


def test_each_package_imports_only_what_its_docstring_says():
    undeclared = []
    for name, path in MODULES.items():
        mine = layer_of(name)
        allowed = declared_imports(mine) if name not in FACE and mine != "ground" else None
        if allowed is None:
            continue
        undeclared += [f"{name} imports {target}, not in toolkit/{mine}/__init__.py's 'May import:'"
                       for target in toolkit_imports(path) if layer_of(target) not in allowed | {mine}]
    assert not undeclared, "\n".join(undeclared)


def test_no_import_cycles():
    graph = {name: {t for t in toolkit_imports(path) if t in MODULES} for name, path in MODULES.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_a_benchmark():
    offenders = [name for name, path in MODULES.items()
                 if any(line.lstrip().startswith(("import benchmarks", "from benchmarks"))
                        for line in path.read_text(encoding="utf-8").splitlines())]
    assert not offenders


def test_no_test_module_imports_another():
    """What several test files share lives in a support module (tests/runtime/zero_helpers.py, ...), so running
    one test file never collects another's tests and fixtures."""
    found = []
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)} imports {n}" for n in names
                      if n.startswith("tests.") and n.split(".")[-1].startswith("test_")]
    assert not found, "\n".join(found)
