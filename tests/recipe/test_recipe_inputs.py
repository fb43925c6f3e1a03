"""Recipe inputs that are not recipes, or values no run can use, through the real
`toolkit validate` / `estimate`: each ends in one `error:` line naming the file or the
key, exit code 2, no traceback, quickly and without echoing a huge value back.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from tests.conftest import run_cli
from toolkit.recipe.load import RecipeError, recipe_from_dict

BASE = {"model": {"size": "tiny"}, "data": {"num_samples": 64}, "batch": {"micro_batch_per_rank": 4},
        "training": {"max_steps": 5}}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _write(path, content) -> str:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


# (id, recipe file content or None for the shipped quickstart, overrides, text the one error line contains)
CASES = [
    ("binary-file", bytes(range(256)) * 4, [], "recipe.json: cannot read: 'utf-8' codec can't decode"),
    ("50-mb-file", '{"description": "' + "x" * (50 << 20) + '"}', [], "recipe.json: larger than 1 MiB, not a recipe"),
    ("nested-600-deep", '{"model": ' + _nested(600) + "}", [], "recipe.json: recipe: nested 601 levels deep"),
    ("nested-override", None, ["optimizer.betas=" + _nested(600)], "recipe.optimizer.betas: nested 600 levels deep"),
    ("duplicate-key-in-override", None, ['scheduler={"type": "WarmupLR", "type": "constant"}'],
     "recipe.scheduler.type: duplicate key"),
    ("duplicate-key-deep-in-file", '{"model": {"size": "tiny"}, "data": {"seed": 1, "seed": 2}}', [],
     "recipe.json: recipe.data.seed: duplicate key"),
    ("number-of-5000-digits", '{"training": {"max_steps": ' + "9" * 5000 + "}}", [],
     "recipe.json: recipe: a number too long to read"),
    ("integer-past-int64", {**BASE, "training": {"max_steps": 2 ** 70}}, [],
     "recipe.training.max_steps: 1180591620717411303424 is out of range"),
    ("float-past-int64-for-an-integer", None, ["data.seq_len=1e300"], "recipe.data.seq_len: 1e+300 is out of range"),
    ("overflowing-float", None, ["optimizer.lr=1e400"], "recipe.optimizer.lr: Infinity is not a finite number"),
    ("nan-override", None, ["model.dropout=NaN"], "recipe.model.dropout: NaN is not a finite number"),
    ("seed-past-2-32", None, ["training.seed=4294967296"], "recipe.training.seed: 4294967296 is greater than"),
    ("branching-past-vocabulary", None, ["data.branching=300"], "recipe.data.branching: 300 exceeds data.vocab_size"),
    ("pretrained-name-too-long", None, ["model.pretrained=" + "a" * 5000],
     "recipe.model.pretrained: cannot read: File name too long"),
    ("huge-key-name", {**BASE, "k" * 100_000: 1}, [], "recipe.kkkk"),
    ("huge-string-value", None, ["zero.offload_optimizer=" + "x" * 100_000], "recipe.zero.offload_optimizer: "),
]


@pytest.mark.parametrize("content,overrides,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("command", ["validate", "estimate"])
def test_input_that_is_not_a_recipe_is_one_short_line(command, content, overrides, expected, tmp_path):
    target = "quickstart" if content is None else _write(tmp_path / "recipe.json", content)
    start = time.perf_counter()
    proc = run_cli(command, target, *overrides, timeout=60)
    assert time.perf_counter() - start < 20
    assert proc.returncode == 2, proc.stderr[:2000]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr[:2000]
    assert len(lines[0]) < 600  # never the whole value back


def test_directory_and_fifo_are_not_recipe_files(tmp_path):
    (tmp_path / "dir.json").mkdir()
    os.mkfifo(tmp_path / "fifo.json")
    for name, why in (("dir.json", "is a directory"), ("fifo.json", "is not a regular file (a FIFO, socket or device)")):
        proc = run_cli("validate", str(tmp_path / name), timeout=30)
        # NOTE: the path may come back shortened (long temporary paths, e.g. under pytest-xdist); the rest is exact
        assert proc.returncode == 2 and proc.stderr.startswith("error: /") and "\n" not in proc.stderr[:-1]
        assert proc.stderr.endswith(f": {why}, expected a recipe JSON file\n"), proc.stderr
    (tmp_path / "child.json").write_text(json.dumps({"extends": "fifo.json"}))
    proc = run_cli("validate", str(tmp_path / "child.json"), timeout=30)
    assert proc.returncode == 2 and "recipe.extends: fifo.json: is not a regular file" in proc.stderr


def test_extends_chain_of_1200_files_loads(tmp_path):
    _write(tmp_path / "r0.json", BASE)
    for i in range(1, 1200):
        _write(tmp_path / f"r{i}.json", {"extends": f"r{i - 1}.json", "training": {"max_steps": i + 1}})
    proc = run_cli("validate", str(tmp_path / "r1199.json"), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "1200 steps" in proc.stdout  # the last file wins


def test_python_api_refuses_a_deeply_nested_dict_in_one_line():
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    with pytest.raises(RecipeError) as caught:
        recipe_from_dict({**BASE, "model": {"size": deep}})
    assert caught.value.lines == ["recipe: nested 5003 levels deep; a recipe needs 4 (at most 100 are read)"]
