"""Real-text recipes: data kinds and their defaults, path variables and globs, the
model's vocabulary from the tokenizer, and a one-line error with exit code 2 for each
bad input (missing files, bad JSONL, corpora too small). Corpora are tiny files
written to tmp_path.
"""
from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest

from tests.conftest import REPO
from tests.text_corpus import python_like_docs, text_recipe, write_corpus
from toolkit.cli.main import main as cli_main
from toolkit.data.paths import PATH_VARIABLES, list_files
from toolkit.data.batches import Dataset
from toolkit.errors import UserError
from toolkit.recipe.load import RecipeError, load_recipe, load_schema, recipe_from_dict
from toolkit.data.tokenizer import train_bpe


# ---------------------------------------------------------------------------
# Recipes: kinds, defaults, variables, vocabulary.


def test_quickstart_resolves_to_exactly_the_synthetic_keys():
    data = load_recipe("quickstart").resolved["data"]
    assert set(data) == {"kind", "seq_len", "vocab_size", "branching", "num_samples", "eval_samples", "seed"}


def test_real_kinds_fill_their_own_defaults(tmp_path):
    write_corpus(tmp_path / "corpus", python_like_docs(3), suffix=".jsonl")
    raw = text_recipe(tmp_path, {"kind": "jsonl", "paths": [str(tmp_path / "corpus" / "*.jsonl")]})
    del raw["data"]["validation_fraction"], raw["data"]["cache_dir"]
    data = recipe_from_dict(raw).resolved["data"]
    assert {k: data[k] for k in ("field", "errors", "tokenizer", "validation_fraction", "exclude", "cache_dir")} == {
        "field": "text", "errors": "strict", "tokenizer": "byte", "validation_fraction": 0.05, "exclude": [],
        "cache_dir": "${cache}/toolkit"}
    assert "vocab_size" not in data and "branching" not in data


@pytest.mark.parametrize("data, message", [
    ({"branching": 3}, "recipe.data.branching: not read with data.kind text and data.tokenizer byte "
                       "(read when data.kind synthetic)"),
    ({"vocab_size": 300}, "recipe.data.vocab_size: not read with data.kind text and data.tokenizer byte"),
    ({"field": "body"}, "recipe.data.field: not read with data.kind text and data.tokenizer byte "
                        "(read when data.kind jsonl)"),
    ({"tokenizer": "bpe"}, "recipe.data.vocab_size: required, missing (data.tokenizer bpe trains"),
    ({"tokenizer": "bpe", "vocab_size": 100}, "recipe.data.vocab_size: 100 is below 258"),
    ({"tokenizer": "pretrained"}, "recipe.data.tokenizer_path: required, missing"),
    ({"paths": ["${nope}/x.txt"]}, "recipe.data.paths[0]: unknown path variable ${nope}"),
    ({"validation_fraction": 0.9}, "recipe.data.validation_fraction: 0.9 is greater than the maximum of 0.5"),
])
def test_data_section_mistakes_name_their_json_path(tmp_path, data, message):
    write_corpus(tmp_path / "corpus", python_like_docs(3))
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(text_recipe(tmp_path, data))
    assert len(info.value.lines) == 1 and info.value.lines[0].startswith(message), info.value.lines


def test_real_data_needs_max_steps_not_epochs(tmp_path):
    write_corpus(tmp_path / "corpus", python_like_docs(3))
    with pytest.raises(RecipeError, match=r"recipe\.training\.epochs: needs data\.kind synthetic"):
        recipe_from_dict(text_recipe(tmp_path, training={"epochs": 1}))


def test_synthetic_rejects_real_text_keys():
    with pytest.raises(RecipeError, match=r"recipe\.data\.paths: not read with data\.kind synthetic \(read when "
                                          r"data\.kind text/jsonl/parquet\)"):
        load_recipe("quickstart", ["data.paths=[\"x\"]"])


def test_model_vocabulary_follows_the_tokenizer(tmp_path):
    write_corpus(tmp_path / "corpus", python_like_docs(30))
    assert recipe_from_dict(text_recipe(tmp_path)).model.vocab_size == 257
    assert recipe_from_dict(text_recipe(tmp_path, {"tokenizer": "bpe", "vocab_size": 512})).model.vocab_size == 512
    tok = train_bpe(python_like_docs(30), vocab_size=320)
    tok.save(tmp_path / "hf-tok")
    pretrained = recipe_from_dict(text_recipe(tmp_path, {"tokenizer": "pretrained", "tokenizer_path": str(tmp_path / "hf-tok")}))
    assert pretrained.model.vocab_size == tok.vocab_size > 257


def test_pretrained_model_must_embed_the_tokenizers_vocabulary(tmp_path):
    write_corpus(tmp_path / "corpus", python_like_docs(3))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 200}))
    raw = text_recipe(tmp_path, model={"pretrained": str(tmp_path / "hf")})
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw)
    assert info.value.lines == ["recipe.model.pretrained: the model embeds 200 token ids, fewer than the data's "
                                "vocabulary of 257 (data.vocab_size or the tokenizer's)"]


def test_path_variables_expand_and_relative_paths_follow_the_recipe_file(tmp_path):
    write_corpus(tmp_path / "corpus", python_like_docs(3))
    raw = text_recipe(tmp_path, {"paths": ["corpus/*.txt", "${python_stdlib}/json/__init__.py"],
                                 "cache_dir": "${recipe_dir}/cache"})
    path = tmp_path / "recipes" / "r.json"
    path.parent.mkdir()
    raw["data"]["paths"][0] = "../corpus/*.txt"
    path.write_text(json.dumps(raw))
    spec = load_recipe(path).data
    assert spec.paths == (str(tmp_path / "corpus" / "*.txt"),
                          os.path.join(sysconfig.get_paths()["stdlib"], "json", "__init__.py"))
    assert spec.cache_dir == tmp_path / "recipes" / "cache"
    assert load_recipe(path).resolved["data"]["paths"][1] == "${python_stdlib}/json/__init__.py"  # hash: as written


def test_every_path_variable_is_documented_in_the_schema_and_readme():
    data = load_schema()["properties"]["data"]
    readme = (REPO / "README.md").read_text()
    for name in PATH_VARIABLES:
        assert "${" + name + "}" in data["description"] and "${" + name + "}" in readme, name


def test_recursive_globs_match_glob_glob_and_skip_excluded_folders(tmp_path):
    import glob

    for rel in ["a.py", "b.txt", "pkg/c.py", "pkg/deep/d.py", "pkg/test/t.py", ".hidden/h.py", "pkg/.e.py",
                "site-packages/big/x.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    for pattern in ["**/*.py", "pkg/**/*.py", "**/d.py", "p?g/*.py", "**/[!a]*.py", "**/[a-c].py"]:
        full = str(tmp_path / pattern)
        assert [str(p) for p in list_files((full,), ())] == sorted(glob.glob(full, recursive=True)), pattern
    kept = list_files((str(tmp_path / "**" / "*.py"),), ("*/site-packages/*", "*/test/*"))
    assert [p.relative_to(tmp_path).as_posix() for p in kept] == ["a.py", "pkg/c.py", "pkg/deep/d.py"]


def test_python_stdlib_recipe_names_about_12_mb_of_sources_without_tests():
    spec = load_recipe("python-stdlib").data
    files = list_files(spec.paths, spec.exclude)
    size = sum(f.stat().st_size for f in files)
    assert 5e6 < size < 40e6 and len(files) > 300
    assert not [f for f in files if "/test/" in f.as_posix() or f.name.startswith("test_")]
    assert spec.tokenizer == "bpe" and spec.validation_fraction > 0


# ---------------------------------------------------------------------------
# Bad inputs: one line, exit code 2, through the CLI.


def run_error(tmp_path, capsys, raw: dict, *overrides: str) -> str:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    code = cli_main(["run", str(path), "--run-dir", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if line.startswith("error:")]
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_missing_file_is_one_line(tmp_path, capsys):
    line = run_error(tmp_path, capsys, text_recipe(tmp_path, {"paths": [str(tmp_path / "nope.txt")]}))
    assert line == f"error: recipe.data.paths[0]: {tmp_path / 'nope.txt'}: no such file"


def test_glob_that_matches_nothing_is_one_line(tmp_path, capsys):
    line = run_error(tmp_path, capsys, text_recipe(tmp_path, {"paths": [str(tmp_path / "x" / "**" / "*.md")]}))
    assert line.endswith("the glob matches no file") and "recipe.data.paths[0]" in line


def test_empty_corpus_is_one_line(tmp_path, capsys):
    write_corpus(tmp_path / "corpus", ["", "", ""])
    assert run_error(tmp_path, capsys, text_recipe(tmp_path)) == (
        "error: recipe.data.paths: the 3 file(s) hold no text (empty corpus)")


def test_non_utf8_bytes_say_where_and_offer_replace(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", python_like_docs(30))
    (corpus / "doc005.txt").write_bytes(b"line one\nline two \xff\xfe bad\n")
    line = run_error(tmp_path, capsys, text_recipe(tmp_path))
    assert line == (f"error: {corpus / 'doc005.txt'}:2: not UTF-8 (byte 0xff at offset 18); "
                    "fix the file or set data.errors to 'replace'")
    ds = Dataset(recipe_from_dict(text_recipe(tmp_path, {"errors": "replace"})).data)
    assert ds.corpus.meta["train_documents"] + ds.corpus.meta["valid_documents"] == 30


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    path = tmp_path / "corpus" / "a.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    raw = text_recipe(tmp_path, {"kind": "jsonl", "paths": [str(path)]})
    assert run_error(tmp_path, capsys, raw).startswith(f"error: {path}:4: not valid JSON: ")


def test_jsonl_line_without_the_field_names_file_and_line(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    path = tmp_path / "corpus" / "a.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text", "id": 2}\n', encoding="utf-8")
    raw = text_recipe(tmp_path, {"kind": "jsonl", "paths": [str(path)]})
    assert run_error(tmp_path, capsys, raw) == f"error: {path}:2: no field 'text' (fields: body, id); set data.field"


def test_jsonl_reads_the_named_field(tmp_path):
    (tmp_path / "corpus").mkdir()
    path = tmp_path / "corpus" / "a.jsonl"
    docs = python_like_docs(12)
    path.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    spec = recipe_from_dict(text_recipe(tmp_path, {"kind": "jsonl", "field": "body", "paths": [str(path)],
                                                   "validation_fraction": 0, "seq_len": 8})).data
    stream = np.asarray(Dataset(spec).corpus.train).tolist()
    assert stream == [t for d in docs for t in [*d.encode(), 256]]


def test_jsonl_streams_lines_keeps_u2028_inside_strings_and_names_a_bad_byte(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    path = tmp_path / "corpus" / "a.jsonl"
    first = b'\xef\xbb\xbf{"text": "a\xe2\x80\xa8b"}\n'  # a byte-order mark, U+2028 inside a string
    path.write_bytes(first + b'{"text": "ok"}\n{"text": "bad \xff"}\n')
    raw = text_recipe(tmp_path, {"kind": "jsonl", "paths": [str(path)], "validation_fraction": 0, "seq_len": 2})
    offset = len(first) + len(b'{"text": "ok"}\n') + len(b'{"text": "bad ')
    assert run_error(tmp_path, capsys, raw) == (f"error: {path}:3: not UTF-8 (byte 0xff at offset {offset}); "
                                                "fix the file or set data.errors to 'replace'")
    raw["data"]["errors"] = "replace"
    stream = np.asarray(Dataset(recipe_from_dict(raw).data).corpus.train).tolist()
    assert stream == [*"a\u2028b".encode(), 256, *b"ok", 256, *"bad \ufffd".encode(), 256]


def test_jsonl_lone_surrogate_escape_is_one_line_or_replaced(tmp_path):
    from toolkit.data.corpus import read_documents

    path = tmp_path / "s.jsonl"
    path.write_text('{"text": "ok \\ud83d half"}\n')
    with pytest.raises(UserError, match=r"s\.jsonl:1: field 'text' holds a lone surrogate escape at character 3"):
        list(read_documents("jsonl", path, field="text", column=None, errors="strict"))
    assert list(read_documents("jsonl", path, field="text", column=None, errors="replace")) == ["ok ? half"]


def test_parquet_reads_the_named_column_and_names_a_missing_one(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "corpus").mkdir()
    path = tmp_path / "corpus" / "a.parquet"
    docs = python_like_docs(12)
    pq.write_table(pa.table({"content": docs, "n": list(range(12))}), path)
    good = text_recipe(tmp_path, {"kind": "parquet", "column": "content", "paths": [str(path)],
                                  "validation_fraction": 0, "seq_len": 8})
    stream = np.asarray(Dataset(recipe_from_dict(good).data).corpus.train).tolist()
    assert stream == [t for d in docs for t in [*d.encode(), 256]]
    bad = text_recipe(tmp_path, {"kind": "parquet", "paths": [str(path)]})
    assert run_error(tmp_path, capsys, bad) == f"error: {path}: no column 'text' (columns: content, n); set data.column"


def test_corpus_too_small_for_one_sequence_is_one_line(tmp_path, capsys):
    write_corpus(tmp_path / "corpus", ["tiny", "text"])
    line = run_error(tmp_path, capsys, text_recipe(tmp_path, {"validation_fraction": 0, "seq_len": 64}))
    assert line == ("error: recipe.data.paths: the training split holds 10 tokens, fewer than one sequence "
                    "(data.seq_len + 1 = 65); add text or lower data.seq_len")


def test_corpus_too_small_for_one_global_batch_is_one_line(tmp_path, capsys):
    write_corpus(tmp_path / "corpus", ["a few words here", "and there"])
    line = run_error(tmp_path, capsys, text_recipe(tmp_path, {"validation_fraction": 0, "seq_len": 4},
                                                   batch={"micro_batch_per_rank": 8}))
    assert line.startswith("error: recipe.data: the training data holds 6 sequences, fewer than one global batch (8)")
