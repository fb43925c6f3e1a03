"""Command-line overrides `key.path=value`: each key checked against the schema
(with a did-you-mean), each value parsed as the JSON type the schema wants there.
"""
from __future__ import annotations

import json
from typing import Any

from toolkit.recipe.files import check_nesting, parse_json
from toolkit.recipe.schema import (TYPE_NAMES, RecipeError, clipped, did_you_mean, exclusive_keys, json_path,
                                   json_type, load_schema)


def _parse_override_value(raw: str, node: dict, keys: list[str]) -> Any:
    """The override's text as the JSON type the schema wants there; raises ValueError naming that type, or
    RecipeError for JSON no recipe reads (too deep, duplicate keys: `files.parse_json`)."""
    kinds = node.get("type")
    if kinds is None and "enum" in node:
        kinds = sorted({json_type(v) for v in node["enum"]})
    kinds = [kinds] if isinstance(kinds, str) else (kinds or ["string"])
    if kinds == ["string"]:
        return raw
    try:
        return parse_json(raw, keys)
    except json.JSONDecodeError:
        if "string" in kinds:
            return raw
        raise ValueError(" or ".join(TYPE_NAMES.get(k, k) for k in kinds)) from None


def _override_target(keys: list[str]) -> tuple[dict | None, dict, str | None]:
    """The schema node at `keys` and its parent's, or None and a one-line reason naming the first key that is wrong."""
    node = parent = load_schema()
    for depth, key in enumerate(keys):
        where = json_path(keys[:depth + 1])
        if node.get("type") != "object" or "properties" not in node:
            return None, parent, f"{json_path(keys[:depth])}: is not an object, so it has no key '{key}'"
        known = node["properties"]
        if key not in known:
            reason = "empty key" if not key else f"unknown key{did_you_mean(key, known)}"
            return None, parent, f"{where}: {reason}"
        parent, node = node, known[key]
    return node, parent, None


def _set_or_remove(target: dict, key: str, value, excluded) -> None:
    """None removes `key`; a value replaces it and removes the keys it excludes."""
    if value is None:
        target.pop(key, None)
        return
    for other in excluded:
        target.pop(other, None)
    target[key] = value


def apply_overrides(recipe: dict, overrides: list[str]) -> dict:
    """Apply `key.path=value` overrides, each typed by the schema; errors name `recipe.key.path`.

    `key.path=null` removes the key. Setting a key removes the keys the schema says it excludes
    (`schema.exclusive_keys`: training.epochs clears max_steps, model.pretrained clears size, ...).
    """
    check_nesting(recipe)
    recipe = json.loads(json.dumps(recipe))
    errors = []
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted:
            errors.append(f"override {clipped(repr(item))}: expected key.path=value (e.g. optimizer.lr=3e-4)")
            continue
        keys = dotted.split(".")
        if keys[0] in ("extends", "$schema", "recipe_hash"):
            errors.append(f"{json_path(keys)}: cannot be overridden (override {clipped(repr(item))}); edit the recipe file")
            continue
        node, parent, reason = _override_target(keys)
        if node is None:
            errors.append(f"{reason} (override {clipped(repr(item))})")
            continue
        try:
            value = None if raw == "null" else _parse_override_value(raw, node, keys)
        except ValueError as exc:
            errors.append(f"{json_path(keys)}: {clipped(repr(raw))} is not {exc} (override {clipped(repr(item))})")
            continue
        except RecipeError as exc:
            errors += [f"{line} (override {clipped(repr(item))})" for line in exc.lines]
            continue
        target = recipe
        for depth, key in enumerate(keys[:-1]):
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                errors.append(f"{json_path(keys[:depth + 1])}: is not an object in the recipe (override {clipped(repr(item))})")
                break
        else:
            _set_or_remove(target, keys[-1], value, exclusive_keys(parent).get(keys[-1], ()))
    if errors:
        raise RecipeError(*errors)
    return recipe
