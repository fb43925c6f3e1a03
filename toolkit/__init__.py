"""toolkit: declarative training recipes (ZeRO, mixed precision, fused kernels).

Importing the package is cheap; torch loads only when a training API is used.
"""
from toolkit.errors import UserError
from toolkit.recipe.load import load_recipe, recipe_from_dict

__all__ = ["UserError", "load_recipe", "recipe_from_dict", "run", "initialize"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `toolkit.run` and `toolkit.initialize` import torch.
    if name == "run":
        from toolkit.train.loop import run
        return run
    if name == "initialize":
        from toolkit.runtime.engine import initialize
        return initialize
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
