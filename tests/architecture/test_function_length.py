"""No function in the package is over 80 lines: a reader holds a function on one screen (shared/STYLE.md).
Read from the source with the AST; a function's length runs from its `def` line to its last line, nested
functions and methods counted on their own too. No function is exempt: issue 32 removed the last long one
(train/loop.py::_train, 124 lines), so a new long function fails here."""
import ast

from tests.conftest import REPO

PACKAGE = REPO / "toolkit"
MAX_LINES = 80


def long_functions(source: str, where: str) -> list[str]:
    """"where::name (N lines)" for each function in `source` over MAX_LINES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{where}::{node.name} ({lines} lines)")
    return found


def test_the_measure_counts_a_function_from_def_to_last_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES - 1))
    assert long_functions(f"def fits():\n{body}", "m") == []  # def + 79 lines = 80
    source = f"class C:\n    async def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}    return 0\n"
    assert long_functions(source, "m") == [f"m::method ({MAX_LINES + 1} lines)"]


def test_no_function_in_the_package_is_over_80_lines():
    found = [line for path in sorted(PACKAGE.rglob("*.py"))
             for line in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert not found, "split these into named steps:\n" + "\n".join(found)
