"""The schema and the specs agree: every property of schemas/recipe.schema.json lands in a field of the typed
specs (toolkit/specs.py) of the same name, in the spec of its section, and every spec field is read somewhere
in the package. Keys that land elsewhere, and fields nothing reads, are listed below with the reason."""
import ast
import dataclasses
import json
import typing

from tests.conftest import REPO
from toolkit import specs
from toolkit.specs import Recipe

SCHEMA = json.loads((REPO / "schemas" / "recipe.schema.json").read_text())
# Schema properties with no same-named field in their section's spec: where they go instead ("Spec.field", or
# None where no spec carries them), and why.
ELSEWHERE = {
    "$schema": (None, "the editor's pointer to the schema, not a setting (recipe_from_dict drops it)"),
    "extends": (None, "recipe/files.py merges the base recipe in before any spec is built"),
    "recipe_hash": ("Recipe.hash", "the hash a run wrote into its recipe.json; load_recipe holds it against "
                                   "the hash it computes"),
    "training.epochs": ("TrainingSpec.max_steps", "recipe/assemble.py turns epochs into max_steps (and "
                                                  "steps_per_epoch) over the synthetic data's size"),
}
# Spec fields no code reads as `.field`, and why each is still there.
NOT_READ_AS_ATTRIBUTE = {
    "Recipe.description": "says what a recipe is, for people; outside the hash (`toolkit recipes` reads the files)",
}


def _spec_classes() -> dict[str, type]:
    return {name: cls for name, cls in vars(specs).items()
            if dataclasses.is_dataclass(cls) and cls.__module__ == specs.__name__}


def _schema_properties(node: dict, path: tuple = ()):
    """(dotted path, property schema) of every property, nested objects and if/then branches included."""
    props = dict(node.get("properties", {}))
    for branch in node.get("allOf", ()):
        for part in ("then", "else"):
            props.update({k: v for k, v in branch.get(part, {}).get("properties", {}).items() if k not in props})
    for key, sub in props.items():
        yield ".".join((*path, key)), sub
        yield from _schema_properties(sub, (*path, key))


def _field_type(cls: type, name: str) -> type | None:
    """The dataclass a field holds, or None when it holds a plain value."""
    hint = typing.get_type_hints(cls)[name]
    return hint if dataclasses.is_dataclass(hint) else None


def _landing(dotted: str) -> str | None:
    """"Spec.field" the schema property lands in by name, section by section, or None."""
    cls = Recipe
    *sections, key = dotted.split(".")
    for section in sections:
        if section not in {f.name for f in dataclasses.fields(cls)} or _field_type(cls, section) is None:
            return None
        cls = _field_type(cls, section)
    return f"{cls.__name__}.{key}" if key in {f.name for f in dataclasses.fields(cls)} else None


def test_every_schema_property_lands_in_a_spec_field():
    missing = [dotted for dotted, _ in _schema_properties(SCHEMA) if _landing(dotted) is None and dotted not in ELSEWHERE]
    assert not missing, f"schema properties with no spec field of their name (add one, or a line to ELSEWHERE): {missing}"


def test_elsewhere_table_names_schema_properties_and_real_fields():
    properties = {dotted for dotted, _ in _schema_properties(SCHEMA)}
    assert set(ELSEWHERE) <= properties, f"stale lines: {sorted(set(ELSEWHERE) - properties)}"
    assert not [k for k in ELSEWHERE if _landing(k)], "these land by name now: drop them from ELSEWHERE"
    classes = _spec_classes()
    for target, _ in ELSEWHERE.values():
        if target is not None:
            cls, field = target.split(".")
            assert field in {f.name for f in dataclasses.fields(classes[cls])}, target


def _attributes_read() -> set[str]:
    """Every attribute name the package reads (`x.name`), specs.py's own properties included."""
    names = set()
    for path in (REPO / "toolkit").rglob("*.py"):
        names.update(node.attr for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load))
    return names


def test_every_spec_field_is_read_somewhere():
    read = _attributes_read()
    fields = {f"{name}.{f.name}" for name, cls in _spec_classes().items() for f in dataclasses.fields(cls)}
    unread = sorted(f for f in fields if f.split(".")[1] not in read and f not in NOT_READ_AS_ATTRIBUTE)
    assert not unread, f"spec fields nothing reads (read them, drop them, or say why in NOT_READ_AS_ATTRIBUTE): {unread}"
    stale = sorted(f for f in NOT_READ_AS_ATTRIBUTE if f not in fields or f.split(".")[1] in read)
    assert not stale, f"NOT_READ_AS_ATTRIBUTE lines that no longer apply: {stale}"
