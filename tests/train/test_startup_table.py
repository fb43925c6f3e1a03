"""The start-up table (toolkit/train/startup_table.py): its precision row comes from
toolkit/runtime/precision.py's `describe_precision`, which owns the 16-bit-weights rule."""
import dataclasses

import pytest

from toolkit.recipe.load import load_recipe
from toolkit.runtime.precision import describe_precision


@pytest.mark.parametrize("dtype, stage, loss_scale, row", [
    ("fp32", 2, 0, "fp32"),
    ("bf16", 0, 0, "bf16 autocast, fp32 weights"),
    ("bf16", 3, 0, "bf16 autocast, 16-bit weights, fp32 master in the ZeRO shard"),
    ("fp16", 0, 0, "fp16 autocast, fp32 weights, dynamic loss scale"),
    ("fp16", 1, 128.0, "fp16 autocast, 16-bit weights, fp32 master in the ZeRO shard, static loss scale"),
])
def test_the_precision_row_names_autocast_weights_and_loss_scale(dtype, stage, loss_scale, row):
    spec = load_recipe("quickstart", []).precision
    spec = dataclasses.replace(spec, dtype=dtype, fp16=dataclasses.replace(spec.fp16, loss_scale=loss_scale))
    assert describe_precision(spec, stage) == row
