"""The record of a DeepSpeed config's conversion (`Conversion`: the recipe keys it sets, and one line per key
about what happened to it) and the helpers every section converter shares (sections.py, optimizer_sections.py).
Torch-free."""
from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.errors import UserError

# Why a key is not carried over, in the three kinds the report uses.
NO_EFFECT = "no effect here"
UNSUPPORTED = "unsupported"


@dataclass
class Conversion:
    """What a DeepSpeed config became: the recipe keys it sets, and one line per key about what happened."""
    recipe: dict = field(default_factory=dict)              # nested recipe keys, only those the config sets
    carried: list[str] = field(default_factory=list)        # "ds.key -> recipe.key = value"
    dropped: list[str] = field(default_factory=list)        # "ds.key: not carried over: why"
    auto: list[tuple[str, str]] = field(default_factory=list)  # ("ds.key", "recipe.path") left to the recipe
    notes: list[str] = field(default_factory=list)          # facts about the result the config does not say
    fp16_if_auto: dict = field(default_factory=dict)       # fp16 loss-scale keys under fp16.enabled "auto"

    def put(self, ds_key: str, recipe_path: str, value) -> None:
        """Carry `value` (DeepSpeed's `ds_key`) to the recipe key `recipe_path` ("zero.stage"); "auto" is left to the recipe."""
        if value == "auto":
            self.auto.append((ds_key, recipe_path))
            return
        node = self.recipe
        *parents, last = recipe_path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
        self.carried.append(f"{ds_key} -> {recipe_path} = {as_json(value)}")

    def drop(self, ds_key: str, why: str) -> None:
        """Report `ds_key` as not carried over, with why (NO_EFFECT, UNSUPPORTED, or `replaced by ...`)."""
        self.dropped.append(f"{ds_key}: not carried over: {why}")


def as_json(value) -> str:
    import json

    return json.dumps(value)


def section_block(ds: dict, key: str) -> dict:
    value = ds.get(key, {})
    if not isinstance(value, dict):
        raise UserError(f"deepspeed config: {key}: expected an object, got {as_json(value)}")
    return value


def is_enabled(block: dict) -> bool | str:
    return block.get("enabled", False)


def drop_unhandled(c: Conversion, prefix: str, block: dict, handled: set[str], reasons: dict[str, str]) -> None:
    """Every key of `block` not in `handled`: dropped, with its reason from `reasons` or UNSUPPORTED."""
    for key in block:
        if key not in handled:
            c.drop(f"{prefix}.{key}", reasons.get(key, UNSUPPORTED))
