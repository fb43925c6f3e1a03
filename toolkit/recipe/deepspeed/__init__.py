"""recipe.deepspeed: a DeepSpeed config becomes a recipe (`toolkit convert`, and
`toolkit.initialize(ds_config_dict, model=...)`).

convert.py reads the file as DeepSpeed does (comments, trailing commas, duplicate
keys refused) and assembles and validates the recipe; sections.py maps each
DeepSpeed block to recipe keys, saying for every key whether it is carried over
and why not. Torch-free.

May import: toolkit.errors, toolkit.regular_files, toolkit.specs and the rest of
toolkit.recipe (files, load, checks, schema): the same as the recipe layer.
"""
from toolkit.recipe.deepspeed.convert import (ConvertedRecipe, convert_deepspeed, is_deepspeed_config,
                                              parse_deepspeed_json, read_deepspeed_config, recipe_from_deepspeed)

__all__ = ["ConvertedRecipe", "convert_deepspeed", "is_deepspeed_config", "parse_deepspeed_json",
           "read_deepspeed_config", "recipe_from_deepspeed"]
