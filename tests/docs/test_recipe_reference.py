"""docs/recipe-reference.md is the schema, read out: the committed page must equal what
docs/make_recipe_reference.py generates from schemas/recipe.schema.json, and a schema change
(tested on a modified copy, never the real file) must make `--check` fail."""
import copy
import importlib.util
import json
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = REPO / "docs" / "make_recipe_reference.py"
PAGE = REPO / "docs" / "recipe-reference.md"


def _generator():
    spec = importlib.util.spec_from_file_location("make_recipe_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema() -> dict:
    return json.loads((REPO / "schemas" / "recipe.schema.json").read_text(encoding="utf-8"))


def _check(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "--check", *map(str, args)], capture_output=True, text=True)


def test_committed_reference_equals_the_page_generated_from_the_schema():
    assert PAGE.read_text(encoding="utf-8") == _generator().render_reference(_schema()), \
        "stale: run python docs/make_recipe_reference.py"
    done = _check()
    assert done.returncode == 0, done.stderr


def test_every_schema_key_appears_with_its_description_and_default():
    page = PAGE.read_text(encoding="utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| `")]

    def walk(node, path):
        for key, child in node.get("properties", {}).items():
            if "properties" in child:  # an object: its own heading, its description under it
                assert f"# `{path}{key}`\n\n{child['description']}\n" in page, f"{path}{key}"
            if not path and "properties" in child:
                walk(child, f"{key}.")
                continue
            described = child["description"].replace("|", "\\|")
            row = next((r for r in rows if r.startswith(f"| `{key}`") and described in r), None)
            assert row is not None, f"{path}{key}"
            if "default" in child:
                assert f"| `{json.dumps(child['default'])}` |" in row, f"{path}{key}"
            walk(child, f"{path}{key}.")

    walk(_schema(), "")


def test_a_changed_description_makes_the_check_fail(tmp_path):
    schema = copy.deepcopy(_schema())
    schema["properties"]["zero"]["properties"]["stage"]["description"] = "A new description of zero.stage."
    changed = tmp_path / "recipe.schema.json"
    changed.write_text(json.dumps(schema), encoding="utf-8")
    done = _check("--schema", changed)
    assert done.returncode == 1 and "recipe-reference.md is stale" in done.stderr
    assert "A new description of zero.stage." in _generator().render_reference(schema)


def test_data_keys_say_under_which_kind_they_are_read():
    text = _generator().render_reference(_schema())
    assert ("When `kind` is `\"text\"`, `\"jsonl\"` or `\"parquet\"` and `tokenizer` is `\"bpe\"`: "
            "`vocab_size` is required.") in text
    assert "| `256` when `kind` is `\"synthetic\"` (or not given) |" in text
    assert "`field` defaults to `\"text\"`" in text.split("When `kind` is `\"jsonl\"`:")[1].split("\n")[0]
    row = next(line for line in text.splitlines() if line.startswith("| `tokenizer_path`"))
    assert "| `kind` is `\"text\"`, `\"jsonl\"` or `\"parquet\"` and `tokenizer` is `\"pretrained\"` |" in row
    assert "| always |" in next(line for line in text.splitlines() if line.startswith("| `seq_len`"))


def test_a_schema_keyword_the_page_cannot_show_stops_the_generator(tmp_path):
    schema = copy.deepcopy(_schema())
    schema["properties"]["zero"]["properties"]["stage"]["multipleOf"] = 1
    try:
        _generator().render_reference(schema)
    except SystemExit as stop:
        assert "zero.stage" in str(stop) and "multipleOf" in str(stop)
    else:
        raise AssertionError("an unrendered keyword went unnoticed")
