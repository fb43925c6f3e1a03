"""Tiny real-text corpora and recipes for the data tests (tests/data/)."""
from __future__ import annotations

from pathlib import Path

from toolkit.data.batches import Dataset
from toolkit.recipe.load import recipe_from_dict


def python_like_docs(n: int) -> list[str]:
    """Small distinct documents with some structure (and multi-byte characters)."""
    return [f"def function_{i}(x, y={i}):\n    \"\"\"Döcstring №{i} ✓\"\"\"\n    return x * {i} + y  # {'é' * (i % 3)}\n"
            for i in range(n)]


def write_corpus(folder: Path, docs: list[str], suffix: str = ".txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i:03d}{suffix}").write_text(doc, encoding="utf-8")
    return folder


def text_recipe(tmp_path: Path, data: dict | None = None, **sections) -> dict:
    """A tiny real-text recipe; data keys override the defaults here."""
    return {
        "model": {"family": "gpt2", "size": "tiny"},
        "data": {"kind": "text", "paths": [str(tmp_path / "corpus" / "*.txt")], "seq_len": 16,
                 "cache_dir": str(tmp_path / "cache"), "validation_fraction": 0.2, **(data or {})},
        "batch": {"micro_batch_per_rank": 2},
        "training": {"max_steps": 4, "eval_interval": 0, "eval_batches": 1, "log_interval": 1},
        **sections,
    }


def dataset_for(tmp_path: Path, data: dict | None = None, docs: list[str] | None = None, **sections) -> Dataset:
    write_corpus(tmp_path / "corpus", docs if docs is not None else python_like_docs(40))
    return Dataset(recipe_from_dict(text_recipe(tmp_path, data, **sections)).data)
