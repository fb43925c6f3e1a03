"""Reading recipe files: a shipped recipe's name or a path, JSON with line:col errors
and duplicate keys refused, and `extends` (a base recipe, merged under the child).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.recipe_schema import RecipeError, _json_path, _json_type
from toolkit.resources import shipped_dir


def find_recipe_file(name_or_path: str | os.PathLike) -> Path:
    """A recipe path, or the name of a shipped recipe (`quickstart`, `recipes/quickstart.json`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    stem = path.name[:-5] if path.name.endswith(".json") else path.name
    shipped = shipped_dir("recipes") / f"{stem}.json"
    if path.parent in (Path("."), Path("recipes")) and shipped.is_file():
        return shipped
    if path.is_dir():
        raise RecipeError(f"{path}: is a directory, expected a recipe JSON file")
    raise RecipeError(f"{path}: recipe file not found (shipped recipes: `toolkit recipes`)")


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
        errors += [f"{_json_path([*parts, k])}: duplicate key (the last one would win)" for k in node.duplicates]
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
    try:
        # NOTE: utf-8-sig also reads files that an editor saved with a byte-order mark.
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise RecipeError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read: {exc}") from None
    if not text.strip():
        raise RecipeError(f"{path}: empty file, expected a JSON object")
    try:
        data = json.loads(text, object_pairs_hook=_object_keeping_duplicates)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a JSON object at the top level, got {_json_type(data)}")
    duplicates = _duplicate_key_errors(data)
    if duplicates:
        raise RecipeError(*(f"{path}: {line}" for line in duplicates))
    return _plain(data)


def deep_merge(base: dict, child: dict) -> dict:
    """Child over base: objects merge key by key, everything else (lists too) replaces."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _load_with_extends(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise RecipeError(f"{chain[-1]}: recipe.extends: cycle {cycle}")
    data = _read_json_object(path)
    data.pop("$schema", None)
    base_ref = data.pop("extends", None)
    if base_ref is None:
        return data
    if not isinstance(base_ref, str):
        raise RecipeError(f"{path}: recipe.extends: {base_ref!r} is not a path string")
    base_path = path.parent / base_ref
    if not base_path.is_file():
        raise RecipeError(f"{path}: recipe.extends: {base_ref}: file not found (looked at {base_path})")
    return deep_merge(_load_with_extends(base_path, (*chain, path)), data)
