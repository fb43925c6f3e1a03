"""Where the files the toolkit ships (schema, recipes, kernel sources) live.

In a source checkout they are the top-level folders beside `toolkit/`; in an
installed package they are copied under `toolkit/_shipped/` (see pyproject.toml).
"""
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """The folder `name` (schemas, recipes, kernels) from the checkout or the installed package."""
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
