"""Reading recipe files: a shipped recipe's name or a path, JSON with line:col errors,
duplicate keys, oversized files and pathological nesting refused (`parse_json`, also used
for override values), and `extends` (a base recipe, merged under the child).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from toolkit.errors import UserError
from toolkit.recipe.schema import RecipeError, clipped, json_path, json_type
from toolkit.regular_files import open_regular_file, regular_file_problem
from toolkit.resources import shipped_dir


def find_recipe_file(name_or_path: str | os.PathLike) -> Path:
    """A recipe path, or the name of a shipped recipe (`quickstart`, `recipes/quickstart.json`)."""
    path = Path(name_or_path)
    problem = regular_file_problem(path)
    if problem is None:
        return path
    stem = path.name[:-5] if path.name.endswith(".json") else path.name
    shipped = shipped_dir("recipes") / f"{stem}.json"
    if path.parent in (Path("."), Path("recipes")) and regular_file_problem(shipped) is None:
        return shipped
    if problem.kind != "missing":
        raise RecipeError(f"{clipped(str(path))}: {_not_a_recipe_file(problem, 'recipe')}")
    raise RecipeError(f"{clipped(str(path))}: recipe file not found (shipped recipes: `toolkit recipes`)")


def _not_a_recipe_file(problem, what: str) -> str:
    """A recipe's words for a `regular_files.FileProblem`: `what` names the file (recipe, base recipe)."""
    if problem.kind == "missing":  # NOTE: a dangling link too: its target is the file not found
        return "file not found"
    if problem.kind == "directory":
        return f"is a directory, expected a {what} JSON file"
    if problem.kind == "special":
        return f"is not a regular file (a FIFO, socket or device), expected a {what} JSON file"
    return clipped(problem.words)


# NOTE: a recipe is a few KB and four levels deep; these caps keep a wrong file (a 50 MB dump, a
# pathological nesting) from taking minutes or Python's recursion limit, and are far above any recipe.
MAX_RECIPE_BYTES = 1 << 20
MAX_NESTING = 100


def _nesting_depth(text: str) -> int:
    """How deeply arrays and objects nest in JSON text (strings skipped), without recursing."""
    depth = deepest = 0
    for bracket in re.findall(r"[\[\]{}]", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def nesting_depth(value) -> int:
    """How deeply lists and dicts nest in a Python value, without recursing."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_nesting(value, parts=()) -> None:
    """Raise a one-line RecipeError when a Python value nests deeper than MAX_NESTING."""
    depth = nesting_depth(value)
    if depth > MAX_NESTING:
        raise RecipeError(f"{json_path(parts)}: nested {depth} levels deep; a recipe needs 4 "
                          f"(at most {MAX_NESTING} are read)")


def parse_json(text: str, parts=()):
    """JSON text as plain values, the way every recipe text is read (files and override values).

    Refused in one line each, naming the JSON path under `parts`: nesting deeper than MAX_NESTING
    (checked before parsing: json.loads and every walker recurse), numbers Python will not read
    (more than 4300 digits) and duplicate keys. A malformed text raises json.JSONDecodeError.
    """
    depth = _nesting_depth(text)
    if depth > MAX_NESTING:
        raise RecipeError(f"{json_path(parts)}: nested {depth} levels deep; a recipe needs 4 "
                          f"(at most {MAX_NESTING} are read)")
    try:
        data = json.loads(text, object_pairs_hook=_object_keeping_duplicates)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise RecipeError(f"{json_path(parts)}: a number too long to read ({clipped(str(exc))})") from None
    duplicates = _duplicate_key_errors(data, tuple(parts))
    if duplicates:
        raise RecipeError(*duplicates)
    return _plain(data)


class _JsonObject(dict):
    """A parsed JSON object that remembers the keys it saw more than once."""
    duplicates: list


def _object_keeping_duplicates(pairs) -> _JsonObject:
    obj = _JsonObject(pairs)
    seen: set = set()
    obj.duplicates = [k for k, _ in pairs if k in seen or seen.add(k)]
    return obj


def _duplicate_key_errors(node, parts=()) -> list[str]:
    """Each key given twice in one object; json.loads would silently keep the last."""
    errors = []
    if isinstance(node, _JsonObject):
        errors += [f"{json_path([*parts, k])}: duplicate key (the last one would win)" for k in node.duplicates]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        errors += _duplicate_key_errors(value, (*parts, key))
    return errors


def _plain(node):
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


def _read_json_object(path: Path) -> dict:
    problem = regular_file_problem(path)
    if problem is not None:
        raise RecipeError(f"{clipped(str(path))}: {_not_a_recipe_file(problem, 'recipe')}")
    try:
        # NOTE: open_regular_file checks the opened file again: a FIFO swapped in since the look above is refused.
        with open_regular_file(path) as file:
            data = file.read(MAX_RECIPE_BYTES + 1)
        if len(data) > MAX_RECIPE_BYTES:  # before decoding: the cut may split a character
            raise RecipeError(f"{path}: larger than {MAX_RECIPE_BYTES >> 20} MiB, not a recipe (a recipe is a few KB)")
        # NOTE: utf-8-sig also reads files that an editor saved with a byte-order mark.
        text = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read: {clipped(str(exc))}") from None
    except RecipeError:
        raise
    except UserError as exc:  # open_regular_file's line
        raise RecipeError(*exc.lines) from None
    if not text.strip():
        raise RecipeError(f"{path}: empty file, expected a JSON object")
    try:
        data = parse_json(text)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
    except RecipeError as exc:
        raise RecipeError(*(f"{path}: {line}" for line in exc.lines)) from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a JSON object at the top level, got {json_type(data)}")
    return data


def deep_merge(base: dict, child: dict) -> dict:
    """Child over base: objects merge key by key, everything else (lists too) replaces."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_with_extends(path: Path) -> dict:
    """The recipe at `path` merged over its `extends` chain, base first; a loop, so a chain may be any length."""
    chain: list[Path] = []
    layers: list[dict] = []
    path = path.resolve()
    while True:
        if path in chain:
            cycle = " -> ".join(p.name for p in (*chain, path))
            raise RecipeError(f"{chain[-1]}: recipe.extends: cycle {cycle}")
        data = _read_json_object(path)
        data.pop("$schema", None)
        chain.append(path)
        layers.append(data)
        base_ref = data.pop("extends", None)
        if base_ref is None:
            break
        if not isinstance(base_ref, str):
            raise RecipeError(f"{path}: recipe.extends: {clipped(json.dumps(base_ref))} is not a path string")
        base_path = path.parent / base_ref
        problem = regular_file_problem(base_path)
        if problem is not None:
            where = f" (looked at {clipped(str(base_path))})" if problem.kind == "missing" else ""
            raise RecipeError(f"{path}: recipe.extends: {clipped(base_ref)}: "
                              f"{_not_a_recipe_file(problem, 'base recipe')}{where}")
        path = base_path.resolve()
    merged = layers.pop()
    while layers:
        merged = deep_merge(merged, layers.pop())
    return merged
