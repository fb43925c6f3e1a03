"""benchmarks/zero_gpu.py's tensor/pipeline rows (tpT, ppP, ppP-tpT): the config names, the recipes they
build at a multi-GPU world size, and the refusals before anything launches (argument handling only: the
rows themselves need several GPUs)."""
import argparse

import pytest

from benchmarks.zero_gpu import engine_recipe, layout_of, main


def _args(**kw):
    base = dict(size="124m", layers=0, width=0, heads=0, micro=8, ckpt=False, offload_ratio=1.0, kernels_off=False,
                device="cuda", state_dtype="fp32")
    return argparse.Namespace(**{**base, **kw})


def test_config_names_give_tensor_and_pipeline_sizes():
    assert [layout_of(c) for c in ("stage0", "stage2-offload", "plain", "tp2", "pp4", "pp2-tp2", "tp4-pp2")] == \
        [(1, 1), (1, 1), (1, 1), (2, 1), (1, 4), (2, 2), (4, 2)]
    for bad in ("tp", "tpx", "pp2-zz2", "tp0"):
        with pytest.raises(SystemExit, match="is not tpT, ppP or ppP-tpT"):
            layout_of(bad)


def test_a_pp2_tp2_row_is_a_stage0_parallel_recipe_over_the_data_parallel_rest():
    recipe = engine_recipe(_args(micro=8), "pp2-tp2", world_size=8)
    p = recipe.parallel
    assert (p.tensor, p.pipeline, p.pipeline_schedule, p.pipeline_microbatches) == (2, 2, "1f1b", 8)
    assert recipe.zero.stage == 0 and recipe.batch.world_size == 2  # data parallel over 8 / (2 x 2)
    assert engine_recipe(_args(micro=6), "pp4", world_size=4).parallel.pipeline_microbatches == 6
    assert not engine_recipe(_args(), "stage1", world_size=4).parallel.active


def test_a_layout_that_does_not_divide_the_gpus_is_refused_before_launching(monkeypatch):
    monkeypatch.setattr("sys.argv", ["zero_gpu", "--gpus", "6", "--configs", "stage0,pp4"])
    with pytest.raises(SystemExit, match="4 ranks per replica do not divide --gpus 6"):
        main()
