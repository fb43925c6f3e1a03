"""Moved to toolkit/recipe/deepspeed/. Kept only for toolkit/runtime/engine.py's lazy import, which its
owner switches to `toolkit.recipe.deepspeed` (issue 32); then this file goes."""
from toolkit.recipe.deepspeed import is_deepspeed_config, recipe_from_deepspeed

__all__ = ["is_deepspeed_config", "recipe_from_deepspeed"]
