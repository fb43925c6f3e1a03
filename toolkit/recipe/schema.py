"""The recipe's JSON Schema and what is read from it: `RecipeError` and the JSON
paths its lines name, validation with did-you-mean hints (`schema_errors`), integer
coercion and the schema's defaults (`fill_defaults`). No torch here.
"""
from __future__ import annotations

import difflib
import json
import math
import sys
from functools import lru_cache
from typing import Any

from toolkit.errors import UserError
from toolkit.resources import schema_path


def clipped(text: str, limit: int = 80) -> str:
    """`text`, or its start and how much was left out: an error line never echoes a whole 50 MB value."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class RecipeError(UserError):
    """The recipe is invalid; one line per problem (each clipped to 400 characters)."""

    def __init__(self, *lines: str):
        super().__init__(*(clipped(str(line), 400) for line in lines))


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The recipe JSON Schema (the contract)."""
    return json.loads(schema_path().read_text())


def json_path(parts) -> str:
    """The JSON path an error line names: `recipe.zero.stage`, `recipe.data.paths[0]` (long keys clipped)."""
    out = "recipe"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{clipped(part, 40)}"
    return out


def json_type(value: Any) -> str:
    """The JSON Schema type name of a parsed JSON value (`integer`, `object`, ...)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if value is None:
        return "null"
    return "string"


def did_you_mean(key: str, known) -> str:
    """The hint after an unknown key: the closest known key, else the list of known keys."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f" (expected one of: {', '.join(sorted(known))})"


# How an error line names each JSON Schema type: `... is not an integer`.
TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string",
              "boolean": "true or false", "object": "an object", "array": "a list"}


def _format_schema_error(error, recipe: dict) -> list[str]:
    where = json_path(error.absolute_path)
    if error.validator == "additionalProperties":
        known = error.schema.get("properties", {}).keys()
        extras = [k for k in error.instance if k not in known]
        return [f"{json_path([*error.absolute_path, k])}: unknown key{did_you_mean(k, known)}" for k in extras]
    if error.validator == "required":
        missing = error.message.split("'")[1]
        why = f" ({error.schema['errorMessage']})" if "errorMessage" in error.schema else ""
        return [f"{json_path([*error.absolute_path, missing])}: required, missing{why}"]
    if error.validator in ("anyOf", "oneOf") and "errorMessage" in error.schema:
        return [f"{where}: {error.schema['errorMessage']}"]
    if error.validator == "type":
        expected = error.validator_value
        expected = [expected] if isinstance(expected, str) else expected
        wanted = " or ".join(TYPE_NAMES.get(t, t) for t in expected)
        return [f"{where}: {clipped(json.dumps(error.instance))} is not {wanted}"]
    if error.validator == "enum":
        hint = ""
        if isinstance(error.instance, str):
            strings = [v for v in error.validator_value if isinstance(v, str)]
            close = difflib.get_close_matches(error.instance, strings, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
        if "then" in error.schema_path and list(error.absolute_path) == ["model", "size"]:
            hint = f" (sizes of family {recipe['model'].get('family', 'gpt2')}){hint}"
        return [f"{where}: {clipped(json.dumps(error.instance))} is not one of {json.dumps(error.validator_value)}{hint}"]
    # jsonschema's messages quote the value (`'xxx' is too long`): quote a long one clipped.
    return [f"{where}: {error.message.replace(repr(error.instance), clipped(repr(error.instance)))}"]


# NOTE: no recipe number is near this (token counts stay below 2**53); past it torch and numpy overflow.
NUMBER_LIMIT = 2 ** 63


def _number_errors(node, parts=()) -> list[str]:
    """NaN and Infinity (Python's JSON reader accepts them and JSON Schema ranges do not catch NaN), and
    numbers past NUMBER_LIMIT, wherever they are in the recipe."""
    if isinstance(node, float) and not math.isfinite(node):
        return [f"{json_path(parts)}: {json.dumps(node)} is not a finite number"]
    if isinstance(node, (int, float)) and not isinstance(node, bool) and abs(node) >= NUMBER_LIMIT:
        return [f"{json_path(parts)}: {clipped(json.dumps(node), 30)} is out of range (a recipe's numbers are "
                "below 2**63)"]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [line for key, value in items for line in _number_errors(value, (*parts, key))]


def _document_order(recipe: dict, parts) -> list[int]:
    """Where a JSON path sits in the recipe as written (key order), so errors read top to bottom."""
    order, node = [], recipe
    for part in parts:
        if isinstance(node, dict) and part in node:
            order.append(list(node).index(part))
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            order.append(part)
        else:
            order.append(len(node) if isinstance(node, (dict, list)) else 0)
            break
        node = node[part]
    return order


def _narrowest_enum_errors(errors: list) -> list:
    """model.size fails both the list of all sizes and its family's list: keep only the family's."""
    narrowest = {}
    for error in errors:
        if error.validator == "enum":
            key = tuple(error.absolute_path)
            if key not in narrowest or len(error.validator_value) < len(narrowest[key].validator_value):
                narrowest[key] = error
    return [e for e in errors if e.validator != "enum" or narrowest[tuple(e.absolute_path)] is e]


def schema_errors(recipe: dict) -> list[str]:
    """Every schema violation, one line each, in document order."""
    numbers = _number_errors(recipe)
    if numbers:
        return numbers
    # NOTE: jsonschema imports rfc3987_syntax when it is installed (jupyter brings it),
    # which spends ~1.6 s building a grammar; recipes use no `format`, so keep it out.
    sys.modules.setdefault("rfc3987_syntax", None)
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(load_schema())
    errors = _narrowest_enum_errors(list(validator.iter_errors(recipe)))
    lines = []
    for error in sorted(errors, key=lambda e: _document_order(recipe, e.absolute_path)):
        lines.extend(_format_schema_error(error, recipe))
    return lines


def exclusive_keys(node: dict) -> dict[str, list[str]]:
    """For each key of an object schema, the keys it excludes (both ways): `oneOf` branches of the form
    `{"required": [a], "not": {"required": [b]}}`, and a property's `excludes` list."""
    pairs = [(a, b) for branch in node.get("oneOf", ()) for a in branch.get("required", ())
             for b in branch.get("not", {}).get("required", ())]
    pairs += [(key, other) for key, sub in node.get("properties", {}).items() for other in sub.get("excludes", ())]
    out: dict[str, list[str]] = {}
    for a, b in pairs:
        for key, other in ((a, b), (b, a)):
            if other not in out.setdefault(key, []):
                out[key].append(other)
    return out


def coerce_integers(node: dict, instance: Any) -> Any:
    """JSON Schema counts 4.0 as an integer; make it the int 4 wherever the schema wants an integer."""
    wants_int = node.get("type") == "integer" or (
        "enum" in node and all(json_type(v) == "integer" for v in node["enum"]))
    if wants_int and isinstance(instance, float) and instance.is_integer():
        return int(instance)
    if isinstance(instance, dict):
        props = node.get("properties", {})
        return {k: coerce_integers(props[k], v) if k in props else v for k, v in instance.items()}
    if isinstance(instance, list) and isinstance(node.get("items"), dict):
        return [coerce_integers(node["items"], v) for v in instance]
    return instance


def matching_branches(node: dict, instance: dict) -> list[dict]:
    """The `then` schemas of `allOf: [{if, then}]` whose `if` the instance satisfies."""
    from jsonschema import Draft202012Validator

    return [branch["then"] for branch in node.get("allOf", ())
            if "if" in branch and "then" in branch and Draft202012Validator(branch["if"]).is_valid(instance)]


def section_defaults(section_schema: dict) -> dict:
    """The schema's default of each key of a section that has one."""
    return {k: v["default"] for k, v in section_schema["properties"].items() if "default" in v}


def fill_defaults(node: dict, instance: dict) -> dict:
    """Fill every absent property that has a schema default; recurse into objects.

    Defaults inside `allOf: [{if, then}]` apply when the `if` holds once the plain defaults
    are in (data.kind synthetic fills vocab_size, kind jsonl fills field, ...).
    """
    out = dict(instance)
    for key, sub in node.get("properties", {}).items():
        if not isinstance(sub, dict):
            continue
        if key not in out and "default" in sub:
            out[key] = json.loads(json.dumps(sub["default"]))
        if sub.get("type") == "object" and "properties" in sub:
            out[key] = fill_defaults(sub, out.get(key, {}))
    for then in matching_branches(node, out):
        for key, sub in then.get("properties", {}).items():
            if key not in out and isinstance(sub, dict) and "default" in sub:
                out[key] = json.loads(json.dumps(sub["default"]))
    return out
