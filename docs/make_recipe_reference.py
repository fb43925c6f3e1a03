"""Writes docs/recipe-reference.md from schemas/recipe.schema.json: every recipe key with its
type, default, allowed values and description, section by section.

The schema is the one source of the recipe format; this page is a reading of it and nothing
more. Run `python docs/make_recipe_reference.py` after editing the schema; `--check` writes
nothing and exits 1 when the committed page differs from what the schema gives (the test in
tests/docs/ runs it). Conditional rules (the schema's if/then branches, e.g. keys that only
some `data.kind` reads) are listed under their section's table, and a key's conditional
default is shown in its row with its condition.

NOTE: every JSON Schema keyword the page renders is listed below; a keyword the schema gains
that this script does not know stops it, so the page never silently leaves a rule out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "schemas" / "recipe.schema.json"
PAGE = REPO / "docs" / "recipe-reference.md"

# Keywords of a key's own schema that the table renders (columns type, default, allowed, description).
KEY_KEYWORDS = {"type", "description", "default", "enum", "minimum", "maximum", "exclusiveMinimum",
                "exclusiveMaximum", "minLength", "minItems", "maxItems", "items", "pattern", "excludes",
                "properties", "additionalProperties", "required", "allOf", "anyOf", "oneOf", "errorMessage"}
TOP_KEYWORDS = KEY_KEYWORDS | {"$schema", "$id", "title"}
BRANCH_KEYWORDS = {"properties", "required", "errorMessage"}  # what a `then` may say
BRANCH_KEY_KEYWORDS = {"default", "enum"}                     # what a `then` may say about one key
# NOTE: in these sections a key that an if/then branch names is read only when one of its branches
# applies, and refused elsewhere (toolkit/recipe/assemble.py, data_spec); their tables get a "read when"
# column. Elsewhere a branch only narrows a key (model.size per family) or changes a default.
READ_ONLY_IN_BRANCH = {"data"}


def _unknown(node: dict, known: set, where: str) -> None:
    extra = sorted(set(node) - known)
    if extra:
        raise SystemExit(f"{where}: schema keyword(s) {extra} are not rendered by {Path(__file__).name}; "
                         "teach it to show them")


def _value(value) -> str:
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _type(node: dict) -> str:
    if "type" in node:
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        text = " or ".join(types)
        if "items" in node and "type" in node["items"]:
            text += f" of {node['items']['type']}"
        return text
    if "enum" in node:  # no "type": the enum's values say it
        names = {bool: "boolean", int: "integer", float: "number", str: "string"}
        return " or ".join(sorted({names.get(type(v), "null") for v in node["enum"]}))
    return "any"


def _range(node: dict) -> list[str]:
    low = ("≥ " + json.dumps(node["minimum"])) if "minimum" in node else (
        ("> " + json.dumps(node["exclusiveMinimum"])) if "exclusiveMinimum" in node else "")
    high = ("≤ " + json.dumps(node["maximum"])) if "maximum" in node else (
        ("< " + json.dumps(node["exclusiveMaximum"])) if "exclusiveMaximum" in node else "")
    return [", ".join(part for part in (low, high) if part)] if low or high else []


def _allowed(node: dict) -> str:
    parts = []
    if "enum" in node:
        parts.append(", ".join(_value(v) for v in node["enum"]))
    parts += _range(node)
    if node.get("minLength") == 1:
        parts.append("non-empty")
    elif "minLength" in node:
        parts.append(f"at least {node['minLength']} characters")
    if "minItems" in node and node.get("minItems") == node.get("maxItems"):
        parts.append(f"exactly {node['minItems']} items")
    else:
        if "minItems" in node:
            parts.append(f"at least {node['minItems']} item{'s' if node['minItems'] != 1 else ''}")
        if "maxItems" in node:
            parts.append(f"at most {node['maxItems']} items")
    if "items" in node:
        items = node["items"]
        _unknown(items, {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength"},
                 "items")
        item_rules = _range(items) + (["non-empty"] if items.get("minLength") == 1 else [])
        if item_rules:
            parts.append("each " + ", ".join(item_rules))
    if "pattern" in node:
        parts.append(f"a string matching `{node['pattern']}`")
    if "excludes" in node:
        parts.append("excludes " + ", ".join(f"`{k}`" for k in node["excludes"]))
    return "; ".join(parts)


def _condition(branch_if: dict, where: str) -> str:
    """`kind` is `text`, `jsonl` or `parquet` and `tokenizer` is `bpe` (an if's properties, in words)."""
    _unknown(branch_if, {"properties", "required"}, where + ".if")
    words = []
    for key, test in branch_if["properties"].items():
        _unknown(test, {"const", "enum"}, f"{where}.if.{key}")
        values = [test["const"]] if "const" in test else test["enum"]
        shown = ", ".join(_value(v) for v in values[:-1]) + " or " + _value(values[-1]) if len(values) > 1 \
            else _value(values[0])
        # JSON Schema: a key the `if` does not require also matches when it is absent (its default applies).
        absent = "" if key in branch_if.get("required", []) else " (or not given)"
        words.append(f"`{key}` is {shown}{absent}")
    return " and ".join(words)


def _branches(node: dict, where: str) -> list[tuple[str, dict]]:
    """The section's if/then rules as (condition in words, then)."""
    out = []
    for i, branch in enumerate(node.get("allOf", [])):
        _unknown(branch, {"if", "then"}, f"{where}.allOf[{i}]")
        then = branch["then"]
        _unknown(then, BRANCH_KEYWORDS, f"{where}.allOf[{i}].then")
        for key, rule in then.get("properties", {}).items():
            _unknown(rule, BRANCH_KEY_KEYWORDS, f"{where}.allOf[{i}].then.{key}")
        out.append((_condition(branch["if"], f"{where}.allOf[{i}]"), then))
    return out


def _branch_line(condition: str, then: dict) -> str:
    said = [f"`{key}` is required" for key in then.get("required", [])]
    for key, rule in then.get("properties", {}).items():
        if "enum" in rule:
            said.append(f"`{key}` is one of {', '.join(_value(v) for v in rule['enum'])}")
        if "default" in rule:
            said.append(f"`{key}` defaults to {_value(rule['default'])}")
    line = f"- When {condition}: {'; '.join(said)}."
    if "errorMessage" in then:
        line += f" If not, validation says: \"{then['errorMessage']}\"."
    return line


def _choice_line(node: dict, where: str) -> list[str]:
    """anyOf / oneOf over required keys: 'give at least / exactly one of ...'."""
    lines = []
    for keyword, words in (("anyOf", "at least one of"), ("oneOf", "exactly one of")):
        if keyword not in node:
            continue
        keys = []
        for i, alternative in enumerate(node[keyword]):
            _unknown(alternative, {"required", "not"}, f"{where}.{keyword}[{i}]")
            keys += alternative["required"]
        line = f"- Give {words} " + ", ".join(f"`{k}`" for k in keys) + "."
        if "errorMessage" in node:
            line += f" If not, validation says: \"{node['errorMessage']}\"."
        lines.append(line)
    return lines


def _section(path: str, node: dict, level: int, title: str = "") -> list[str]:
    """One object: its description, a table of its keys, its rules, then its nested objects."""
    _unknown(node, KEY_KEYWORDS, path)
    if node.get("additionalProperties", False) is not False:  # the page says unlisted keys are refused
        raise SystemExit(f"{path}: additionalProperties is not false; the page's 'unknown key' line would be wrong")
    branches = _branches(node, path)
    lines = [f"{'#' * level} {title or f'`{path}`'}", ""]
    if node.get("description"):
        lines += [node["description"], ""]
    read_when = {}
    if path in READ_ONLY_IN_BRANCH:
        for condition, then in branches:
            for key in (*then.get("properties", {}), *then.get("required", [])):
                read_when.setdefault(key, []).append(condition)
    columns = ["key", "type", "default", "allowed", *(["read when"] if read_when else []), "description"]
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    nested = []
    required = node.get("required", [])
    for key, child in node["properties"].items():
        _unknown(child, KEY_KEYWORDS, f"{path}.{key}")
        defaults = [_value(child["default"])] if "default" in child else []
        defaults += [f"{_value(then['properties'][key]['default'])} when {condition}"
                     for condition, then in branches if "default" in then.get("properties", {}).get(key, {})]
        name = f"`{key}`" + (" (required)" if key in required else "")
        description = child.get("description", "")
        if "properties" in child:
            nested.append((f"{path}.{key}", child))
            description += f" Keys: see `{path}.{key}` below."
        when = ["; or ".join(dict.fromkeys(read_when.get(key, ["always"])))] if read_when else []
        lines.append("| " + " | ".join(_cell(c) for c in (
            name, _type(child), "; ".join(defaults), _allowed(child), *when, description.strip())) + " |")
    rules = _choice_line(node, path) + [_branch_line(condition, then) for condition, then in branches]
    if rules:
        lines += ["", "Rules between keys:", "", *rules]
    if read_when:
        lines += ["", f"A `{path}` key given where its \"read when\" does not hold is an error naming when it is read."]
    lines.append("")
    for child_path, child in nested:
        lines += _section(child_path, child, level + 1)
    return lines


def render_reference(schema: dict) -> str:
    """The whole reference page for this schema, as Markdown."""
    _unknown(schema, TOP_KEYWORDS, "recipe")
    lines = [
        "# Recipe reference",
        "",
        "<!-- Generated by docs/make_recipe_reference.py from schemas/recipe.schema.json; do not edit. -->",
        "",
        "Every key of a recipe, section by section, with its type, default, allowed values and meaning, read from",
        "[`schemas/recipe.schema.json`](../schemas/recipe.schema.json) (`toolkit schema` prints it).",
        "A key that is not listed is refused (`unknown key`), and a default shown here is the one the",
        "toolkit uses. How the sections fit together: [recipes.md](recipes.md).",
        "",
        "Required sections: " + ", ".join(f"`{k}`" for k in schema.get("required", [])) + ".",
        "Sections: " + ", ".join(f"[`{k}`](#{k})" for k, v in schema["properties"].items() if "properties" in v)
        + ".",
        "",
    ]
    top = {k: v for k, v in schema["properties"].items() if "properties" not in v}
    lines += _section("recipe", {"properties": top, "description": "Keys at the top of the file.",
                                 "required": [k for k in schema.get("required", []) if k in top]}, 2, "Top-level keys")
    for key, node in schema["properties"].items():
        if "properties" in node:
            lines += _section(key, node, 2)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the page (or, with --check, say whether the committed one is stale: exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is stale")
    parser.add_argument("--schema", type=Path, default=SCHEMA, help="schema to read (default: the repository's)")
    parser.add_argument("--page", type=Path, default=PAGE, help="page to write or check")
    args = parser.parse_args(argv)
    text = render_reference(json.loads(args.schema.read_text(encoding="utf-8")))
    if args.check:
        current = args.page.read_text(encoding="utf-8") if args.page.is_file() else None
        if current != text:
            print(f"{args.page} is stale: run python docs/make_recipe_reference.py", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
