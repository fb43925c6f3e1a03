"""recipe.parallel: the data-parallel size resolves the batch, and impossible layouts are one line each."""
import pytest

from toolkit.recipe.load import RecipeError, load_recipe


def test_batch_is_resolved_over_data_parallel_ranks():
    recipe = load_recipe("quickstart", ["parallel.tensor=2", "parallel.pipeline=2", "model.n_layer=4"], world_size=8)
    assert (recipe.batch.world_size, recipe.world_size, recipe.batch.global_batch) == (2, 8, 32)


def test_zero1_composes_with_a_mesh():
    recipe = load_recipe("quickstart", ["parallel.tensor=2", "parallel.pipeline=2", "model.n_layer=4",
                                        "zero.stage=1"], world_size=8)
    assert (recipe.zero.stage, recipe.batch.world_size) == (1, 2)


@pytest.mark.parametrize("overrides, world, expected", [
    (["parallel.tensor=3"], 4, "recipe.parallel: tensor 3 x pipeline 1 = 3 ranks per model replica do not divide"),
    (["parallel.tensor=8"], 8, "recipe.model.n_head: 4 is not divisible by parallel.tensor 8"),
    (["parallel.pipeline=4"], 4, "recipe.model.n_layer: 2 layers do not split into 4 equal pipeline stages"),
    (["parallel.pipeline=2", "zero.stage=2"], 2, "recipe.zero.stage: 2 with parallel.pipeline 2"),
    (["parallel.tensor=2", "zero.stage=3"], 2, "recipe.zero.stage: 3 with parallel tensor 2: the data-parallel"),
    (["parallel.tensor=2", "zero.stage=1", "zero.offload_optimizer=cpu"], 2,
     "recipe.zero.offload_optimizer: 'cpu' with parallel tensor 2 / pipeline 1"),
    (["parallel.pipeline=2", "parallel.pipeline_microbatches=3"], 2,
     "recipe.batch.micro_batch_per_rank: 16 is not divisible by parallel.pipeline_microbatches 3"),
])
def test_impossible_layouts_are_one_line_errors(overrides, world, expected):
    with pytest.raises(RecipeError) as caught:
        load_recipe("quickstart", overrides, world_size=world)
    assert any(line.startswith(expected) for line in str(caught.value).splitlines()), str(caught.value)
