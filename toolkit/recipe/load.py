"""Recipe loading: JSON file -> `extends` -> CLI overrides -> schema validation ->
defaults -> semantic checks -> a frozen, typed `Recipe` with one spec per section.

Every problem is reported as one line naming its JSON path (`recipe.zero.stage:
4 is not one of [0, 1, 2, 3]`), and all problems are collected before raising.
No torch here: `toolkit validate` must answer in well under a second.

Where it lives: this module builds the `Recipe` (`build_recipe`, `load_recipe`,
`recipe_from_dict`) and re-exports the public names of the others, so import from
toolkit.recipe.load. files.py reads files and `extends`; overrides.py applies
`key.path=value`; schema.py validates and fills defaults; assemble.py turns the
filled dict into the specs (with the checks that come with each); checks.py holds
the semantic checks that build nothing. The names these siblings hand each other are
public (no underscore); an underscore name is private to its file.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from toolkit.recipe.assemble import assemble_recipe, resolve_batch
from toolkit.recipe.checks import resolve_world_size
from toolkit.recipe.files import check_nesting, deep_merge, find_recipe_file, load_with_extends
from toolkit.recipe.overrides import apply_overrides
from toolkit.recipe.schema import RecipeError, coerce_integers, fill_defaults, load_schema, schema_errors
from toolkit.specs import Recipe

__all__ = ["RecipeError", "apply_overrides", "build_recipe", "deep_merge", "fill_defaults", "find_recipe_file",
           "load_recipe", "load_schema", "recipe_from_dict", "resolve_batch", "schema_errors"]


# Recipe keys whose relative paths are taken from the recipe's folder (the schema's descriptions say so).
_PATHS_FROM_RECIPE_DIR = (("data", "paths"), ("data", "cache_dir"), ("data", "tokenizer_path"), ("model", "pretrained"))


def _anchored(value: str, recipe_dir: Path) -> str:
    """A path as the recipe wrote it, made independent of the recipe's folder (other ${variables} stay)."""
    if value.startswith("${recipe_dir}"):
        return str(recipe_dir) + value[len("${recipe_dir}"):]
    if value.startswith(("${", "~")) or os.path.isabs(value):
        return value
    return os.path.normpath(os.path.join(recipe_dir, value))


def _anchor_paths(r: dict, recipe_dir: Path | None) -> None:
    """Relative paths taken from the recipe's folder, so the resolved recipe (a run's recipe.json) reruns anywhere."""
    recipe_dir = (recipe_dir or Path.cwd()).absolute()
    for section, key in _PATHS_FROM_RECIPE_DIR:
        value = r[section].get(key)
        if isinstance(value, list):
            r[section][key] = [_anchored(v, recipe_dir) for v in value]
        elif isinstance(value, str):
            r[section][key] = _anchored(value, recipe_dir)


def build_recipe(raw: dict, *, source: Path | None = None, world_size: int | None = None,
                 default_name: str = "recipe") -> Recipe:
    """Validate a merged recipe dict and build the typed `Recipe`; raises RecipeError with every problem."""
    check_nesting(raw)  # the Python API's dicts too: every walker below recurses
    world_size, errors = resolve_world_size(world_size)
    errors += schema_errors(raw)
    if errors:
        raise RecipeError(*errors)
    raw = coerce_integers(load_schema(), {k: v for k, v in raw.items() if k != "recipe_hash"})
    r = fill_defaults(load_schema(), raw)
    recipe_dir = source.parent if source is not None else None
    _anchor_paths(r, recipe_dir)
    return assemble_recipe(r, raw, source=source, world_size=world_size, default_name=default_name)


def load_recipe(path_or_name: str | os.PathLike, overrides: list[str] | tuple = (), *,
                world_size: int | None = None) -> Recipe:
    """Load, extend, override, validate and type a recipe file (or a shipped recipe's name)."""
    path = find_recipe_file(path_or_name)
    written = load_with_extends(path)
    default_name = path.name[:-5] if path.name.endswith(".json") else path.name
    recipe = build_recipe(apply_overrides(written, list(overrides)), source=path, world_size=world_size,
                          default_name=default_name)
    written_hash = written.get("recipe_hash")
    if written_hash is not None and not overrides and written_hash != recipe.hash:
        return dataclasses.replace(recipe, warnings=(
            *recipe.warnings, f"recipe.recipe_hash: {written_hash} is not this recipe's hash {recipe.hash} (the file "
                              "was edited since its run wrote it, or written by another toolkit version)"))
    return recipe


def recipe_from_dict(raw: dict, overrides: list[str] | tuple = (), *, world_size: int | None = None,
                     name: str = "recipe") -> Recipe:
    """Build a Recipe from a dict (the Python API and tests); same checks as a file."""
    raw = {k: v for k, v in raw.items() if k != "$schema"}
    if "extends" in raw:
        raise RecipeError("recipe.extends: only recipe files can extend (paths are relative to the file)")
    return build_recipe(apply_overrides(raw, list(overrides)), world_size=world_size, default_name=name)
