"""Tensor and pipeline parallelism (recipe.parallel) on gloo with 4 ranks, against one process.

One torch.multiprocessing launch of 4 (forked) ranks runs every layout in turn for a tiny GPT-2 and a
tiny Llama (4 layers, fp32, 5 steps, the same global batch of 16): (tp2, dp2), (pp2, dp2) under 1F1B and
under interleaved 1F1B, (pp2, tp2) under GPipe, (pp4), and (tp2, dp2) and (pp2, dp2) with ZeRO-1 over dp;
the ranks write their losses, gradient norms, a held-out loss (a pipeline's through its forward-only schedule)
and consolidated parameters to files and the assertions run
here against one process (the ordinary engine, no mesh). The (pp2, dp2, ZeRO-1) run saves a checkpoint
(each dp rank holding half the moments) that resumes in the same launch at (dp 4, ZeRO-1) and at (tp2,
dp2, ZeRO-1), and here on one process: all go on as the one-process run that never stopped (same
tolerance).

Tolerance: rtol 1e-5 plus atol 2e-5 on parameters, rtol 1e-5 on losses and norms. A tensor-parallel
matmul sums its partial products in another order (the row-parallel all-reduce), a pipeline computes
the micro-batches' losses separately and sums their gradients: the last bits differ, and AdamW turns a
last-bit difference of a near-zero gradient into a visible fraction of lr (3e-3) for that element (see
tests/runtime/test_zero_dist.py). A real bug (a missing reduction, a wrong shard, a stage's blocks
skipped) moves parameters by ~lr per step, 100 times the tolerance.
"""
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import become_rank, free_port
from tests.runtime.zero_helpers import BASE as ZERO_BASE

pytestmark = pytest.mark.dist

STEPS = 5  # NOTE: CI budget; a wrong shard or a missing reduction shows from the first step
RESUMED = 2  # steps after a resume
RTOL, ATOL = 1e-5, 2e-5
# zero_helpers' tiny ZeRO recipe with 4 blocks (two pipeline stages of two) and this file's step count.
BASE = {**ZERO_BASE, "model": {**ZERO_BASE["model"], "n_layer": 4},
        "training": {**ZERO_BASE["training"], "max_steps": STEPS}}
LAYOUTS = {
    "tp2-dp2": ["parallel.tensor=2"],
    "pp2-dp2": ["parallel.pipeline=2", "parallel.pipeline_microbatches=4"],
    "pp2-dp2-interleaved": ["parallel.pipeline=2", "parallel.pipeline_microbatches=4",
                            "parallel.pipeline_schedule=interleaved_1f1b"],
    "pp2-tp2": ["parallel.pipeline=2", "parallel.tensor=2", "parallel.pipeline_schedule=gpipe",
                "parallel.pipeline_microbatches=2", "batch.grad_accum_steps=2"],
    "pp4": ["parallel.pipeline=4", "parallel.pipeline_microbatches=8"],
    "tp2-dp2-zero1": ["parallel.tensor=2", "zero.stage=1"],
    "pp2-dp2-zero1": ["parallel.pipeline=2", "parallel.pipeline_microbatches=4", "zero.stage=1"],
}
FAMILIES = {"gpt2": [], "llama": ["model.family=llama"]}
SAVED = "gpt2-pp2-dp2-zero1"  # its checkpoint resumes at dp4 and tp2-dp2-zero1 (in the launch), on one process (here)
RESUMED_KEY = "gpt2-resumed-dp4"
RESUMED_TP_KEY = "gpt2-resumed-tp2-dp2-zero1"
DP4 = ["zero.stage=1"]  # a resume layout: plain data parallelism over 4 ranks
# NOTE: CI budget: the default launch runs GPT-2 in every layout and Llama in the two that cover both of its
# plans (tensor and pipeline); Llama's other layouts run in a second launch, with TOOLKIT_ALL_LAYOUTS=1.
FAST = [f"gpt2-{name}" for name in LAYOUTS] + ["llama-tp2-dp2", "llama-pp2-tp2"]
SLOW = ["llama-pp2-dp2", "llama-pp2-dp2-interleaved", "llama-pp4"]


def start(world, overrides, resume_from=None):
    """(engine, data stream) of a layout; after loading `resume_from`, if given, with the stream moved on
    to the checkpoint's step."""
    from toolkit.data.batches import BatchStream, Dataset
    from toolkit.recipe.load import recipe_from_dict
    from toolkit.runtime.engine import Engine

    recipe = recipe_from_dict(BASE, overrides, world_size=world)
    engine = Engine(recipe)
    rank = engine.strategy.mesh.dp_rank if recipe.parallel.active else engine.dist.rank
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=rank, seed=recipe.training.seed)
    if resume_from is not None:
        path, _ = engine.load_checkpoint(resume_from)
        assert path is not None and engine.global_step == STEPS
        stream.load_state_dict({"epoch": 0, "step_in_epoch": STEPS})
    return engine, stream


def steps(engine, stream, count) -> dict:
    """Losses and grad norms of `count` optimizer steps, then the held-out loss of one fixed micro batch."""
    results = [engine.train_batch(stream.next_step()) for _ in range(count)]
    return {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
            "eval": evaluations(engine, [engine.recipe.batch.micro_batch_per_rank])}


def evaluations(engine, sizes) -> dict[int, float]:
    """The held-out loss of a fixed micro batch of each size in `sizes` (rows)."""
    return {rows: engine.evaluate([held_out(rows)]) for rows in sizes}


def held_out(rows: int) -> torch.Tensor:
    """The same token ids on every rank (a pipeline evaluates through its forward-only schedule)."""
    return torch.randint(0, BASE["data"]["vocab_size"], (rows, BASE["data"]["seq_len"] + 1),
                         generator=torch.Generator().manual_seed(7))


def replica_parameters(engine) -> dict:
    """Every parameter of a replicated (not tensor- or pipeline-parallel) model, flat."""
    return {n: p.detach().clone().reshape(-1) for n, p in engine.model.named_parameters()}


def whole_parameters(engine) -> dict:
    """Every parameter whole (this rank's owned pieces; every rank must call it)."""
    return {name: views["param"].clone() for name, _, _, views in engine.strategy.owned_pieces()}


def _rank_main(rank, world, port, out_dir, keys):
    become_rank(rank, world, port)
    results = {}
    for key in keys:
        family, name = key.split("-", 1)
        engine, stream = start(world, FAMILIES[family] + LAYOUTS[name])
        results[key] = {**steps(engine, stream, STEPS), "params": whole_parameters(engine),
                        "memory": engine.strategy.memory_bytes()}
        if key == SAVED:
            engine.save_checkpoint(out_dir / "checkpoints")
            engine, stream = start(world, DP4, resume_from=out_dir / "checkpoints")
            results[RESUMED_KEY] = {**steps(engine, stream, RESUMED), "params": replica_parameters(engine)}
            engine, stream = start(world, LAYOUTS["tp2-dp2-zero1"], resume_from=out_dir / "checkpoints")
            results[RESUMED_TP_KEY] = {**steps(engine, stream, RESUMED), "params": whole_parameters(engine)}
    torch.save(results, out_dir / f"rank{rank}-{len(keys)}.pt")
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel")


def launch(out_dir, keys):
    # NOTE: forked ranks inherit the parent's imports (transformers, the engine): on a loaded 2-core machine
    # importing them costs several seconds per process, more than the training here.
    from transformers import GPT2LMHeadModel  # noqa: F401
    import toolkit.runtime.engine  # noqa: F401

    mp.start_processes(_rank_main, args=(4, free_port(), out_dir, keys), nprocs=4, join=True, start_method="fork")
    return [torch.load(out_dir / f"rank{r}-{len(keys)}.pt", weights_only=False) for r in range(4)]


@pytest.fixture(scope="module")
def ranks(out_dir):
    return launch(out_dir, FAST)


@pytest.fixture(scope="module")
def slow_ranks(out_dir):
    return launch(out_dir, SLOW)


def merged_parameters(ranks, key) -> dict:
    merged = {}
    for r in ranks:
        merged.update(r[key]["params"])
    return merged


@pytest.fixture(scope="module")
def reference():
    """One process, the same global batch: the engine without a mesh (GPT-2 also RESUMED steps further)."""
    torch.set_num_threads(1)
    out = {}
    for family, family_overrides in FAMILIES.items():
        engine, stream = start(1, family_overrides)
        out[family] = {**steps(engine, stream, STEPS), "params": replica_parameters(engine)}
        out[family]["eval"].update(evaluations(engine, [4, 8]))  # the layouts' micro batches: 4 to 16 rows
        if family == "gpt2":
            out[RESUMED_KEY] = {**steps(engine, stream, RESUMED), "params": replica_parameters(engine)}
            out[RESUMED_KEY]["eval"].update(evaluations(engine, [4, 8]))
    return out


@pytest.mark.parametrize("key", FAST)
def test_layout_matches_one_process(ranks, reference, key):
    check_against_one_process(ranks, reference, key)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TOOLKIT_ALL_LAYOUTS"), reason="a second 4-rank launch (~20 s on 2 cores); "
                    "set TOOLKIT_ALL_LAYOUTS=1")
@pytest.mark.parametrize("key", SLOW)
def test_more_llama_layouts_match_one_process(slow_ranks, reference, key):
    check_against_one_process(slow_ranks, reference, key)


def check_against_one_process(ranks, reference, key, ref_key=None):
    """Whole parameters, and every rank's losses and norms, equal one process's at the module's tolerance."""
    ref = reference[ref_key or key.split("-", 1)[0]]
    merged = merged_parameters(ranks, key)
    assert set(merged) == set(ref["params"])
    for name, full in merged.items():
        torch.testing.assert_close(full, ref["params"][name], rtol=RTOL, atol=ATOL, msg=f"{key} {name}")
    for r in ranks:  # every rank reports the same loss and norm as one process
        torch.testing.assert_close(torch.tensor(r[key]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(r[key]["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL,
                                   atol=0)
        for rows, loss in r[key]["eval"].items():  # a pipeline's through its forward-only schedule
            assert loss == pytest.approx(ref["eval"][rows], rel=RTOL), f"{key} held-out loss of {rows} rows"


@pytest.mark.parametrize("key", [RESUMED_KEY, RESUMED_TP_KEY])
def test_checkpoint_saved_at_pp2_dp2_zero1_resumes_in_another_layout(ranks, reference, key):
    """The (pp 2, dp 2, ZeRO-1) checkpoint loaded by (dp 4, ZeRO-1) and by (tp 2, dp 2, ZeRO-1) trains on as
    the one process that never stopped."""
    check_against_one_process(ranks, reference, key, RESUMED_KEY)


def test_zero1_over_a_mesh_keeps_a_share_of_the_moments_per_dp_rank(ranks):
    """Under (tp 2, dp 2, ZeRO-1) each tensor rank's moments are split between its two dp ranks: every rank holds
    fewer than without ZeRO-1, and the four together half as many (each once per tensor rank, not twice)."""
    mem = [r["gpt2-tp2-dp2-zero1"]["memory"] for r in ranks]
    plain = [r["gpt2-tp2-dp2"]["memory"] for r in ranks]
    assert all(m["mem_optim_bytes"] < p["mem_optim_bytes"] for m, p in zip(mem, plain))
    assert sum(m["mem_optim_bytes"] for m in mem) == sum(p["mem_optim_bytes"] for p in plain) // 2


def test_checkpoint_saved_at_pp2_dp2_zero1_resumes_on_one_process(ranks, reference, out_dir):
    """A checkpoint of (pp 2, dp 2, ZeRO-1) loads into the one-process engine: the same whole weights and
    AdamW moments, and training goes on as the one process that never stopped."""
    torch.set_num_threads(1)
    engine, stream = start(1, [], resume_from=out_dir / "checkpoints")
    saved = merged_parameters(ranks, SAVED)
    for name, p in replica_parameters(engine).items():
        torch.testing.assert_close(p, saved[name], rtol=0, atol=0, msg=name)
    assert engine.strategy.optimizer_steps() == STEPS
    assert all(s["exp_avg"].abs().sum() > 0 for s in engine.optimizer.state.values())
    resumed = {**steps(engine, stream, RESUMED), "params": replica_parameters(engine)}
    check_against_one_process([{RESUMED_KEY: resumed}], reference, RESUMED_KEY, RESUMED_KEY)
