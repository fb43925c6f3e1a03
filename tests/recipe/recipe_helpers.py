"""Small recipes for the recipe tests: MINIMAL and ways to vary and write it."""
import json
from pathlib import Path

MINIMAL = {
    "model": {"family": "gpt2", "size": "tiny"},
    "data": {"kind": "synthetic", "seq_len": 32, "vocab_size": 64, "num_samples": 256, "eval_samples": 32},
    "batch": {"micro_batch_per_rank": 4},
    "training": {"max_steps": 20},
}


def recipe(**sections) -> dict:
    """MINIMAL with whole sections replaced (or added)."""
    return {**json.loads(json.dumps(MINIMAL)), **sections}


def with_key(section: str, key: str, value) -> dict:
    """MINIMAL with one key added inside a (dotted) section, creating the section if needed."""
    out = recipe()
    node = out
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = value
    return out


def write(path: Path, content) -> Path:
    """Write a recipe (dict -> JSON, str -> as is) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return path
