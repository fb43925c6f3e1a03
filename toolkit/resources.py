"""Where the files the toolkit ships (schema, recipes, kernel sources, the
benchmark figures) live.

In a source checkout they are the top-level folders beside `toolkit/`; in an
installed package they are copied under `toolkit/_shipped/` (see pyproject.toml).
Of benchmarks/ only RESULTS.md ships: the tutorials quote its figures.
"""
import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """The folder `name` (schemas, recipes, kernels, benchmarks) from the checkout or the installed package."""
    checkout = _PACKAGE.parent / name
    if (_PACKAGE.parent / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout
    return _PACKAGE / "_shipped" / name


def checkout_dir(name: str) -> Path:
    """The folder `name` (tutorials) beside the package in a source checkout; an installed package has none."""
    return _PACKAGE.parent / name


def schema_path() -> Path:
    """The recipe JSON Schema."""
    return shipped_dir("schemas") / "recipe.schema.json"


def results_path() -> Path:
    """benchmarks/RESULTS.md: the committed benchmark figures (the only file of benchmarks/ that ships)."""
    return shipped_dir("benchmarks") / "RESULTS.md"


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME, else ~/.cache: under it the toolkit's caches (kernels, bytecode) and a recipe's ${cache}."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
