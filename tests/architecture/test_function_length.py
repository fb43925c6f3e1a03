"""A function fits on a screen (STYLE.md): none in toolkit/runtime is over 80 lines."""
import ast

from tests.conftest import REPO

LIMIT = 80


def long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function or method longer than LIMIT lines, decorators excluded."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LIMIT]


def test_the_scan_counts_lines():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    assert long_functions(f"def f():\n{body}\n") == [("f", LIMIT + 1)]
    assert long_functions("def g():\n    pass\n") == []


def test_no_runtime_function_is_over_80_lines():
    found = [f"{path.relative_to(REPO)}:{name} ({n} lines)" for path in sorted((REPO / "toolkit" / "runtime").rglob("*.py"))
             for name, n in long_functions(path.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)
