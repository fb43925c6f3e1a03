"""Below the engine nothing reads a `Recipe` (docs' "Seams"): no module under toolkit/runtime except engine.py
imports or names `Recipe`, and no function there takes a `recipe` parameter; the engine hands each component
its specs (ZeroSpec, OptimizerSpec, ParallelSpec, ...)."""
import ast

from tests.conftest import REPO

RUNTIME = REPO / "toolkit" / "runtime"
ENGINE = RUNTIME / "engine.py"


def recipe_uses(source: str) -> list[str]:
    """`Recipe` named or imported, and functions with a parameter called `recipe`, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "Recipe":
            found.append(f"{node.lineno}: names Recipe")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "Recipe" for a in node.names):
            found.append(f"{node.lineno}: imports Recipe")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            if any(a.arg == "recipe" for a in params):
                found.append(f"{node.lineno}: {node.name}(recipe)")
    for node in ast.walk(ast.parse(source)):  # string annotations ("Recipe") count too
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "Recipe":
            found.append(f"{node.lineno}: names Recipe")
    return found


def test_the_scan_finds_recipe_uses():
    source = "from toolkit.specs import Recipe\ndef f(model, recipe):\n    pass\ndef g(x: Recipe):\n    pass\n"
    assert recipe_uses(source) == ["1: imports Recipe", "2: f(recipe)", "4: names Recipe"]
    assert recipe_uses("def f(zero: ZeroSpec):\n    '''from a recipe'''\n") == []


def test_no_module_below_the_engine_takes_a_recipe():
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if path == ENGINE:
            continue
        rel = path.relative_to(RUNTIME).as_posix()
        found += [f"toolkit/runtime/{rel}:{use}" for use in recipe_uses(path.read_text(encoding="utf-8"))]
    assert not found, "a Recipe below the engine (hand it the specs instead):\n" + "\n".join(found)
