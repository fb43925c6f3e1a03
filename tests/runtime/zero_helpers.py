"""The tiny ZeRO runs the runtime tests share (tests/runtime/test_zero_dist.py, test_zero_single.py,
test_zero_infinity.py, ...): the base recipe, an engine and its batch stream, N optimizer steps, and the
parameter comparison with its tolerance.

Tolerance (one reason for all comparisons of parameters): rtol 1e-5 plus atol
1e-5. Runs at different world sizes or stages sum the same gradients in another
order (the ranks' mean versus one batch mean; all-reduce versus reduce-scatter
rings), so gradients differ in the last bit. AdamW divides each element's step
by its own gradient scale, so for elements whose gradient is close to zero
(rare embedding rows) that last bit moves the step by a visible fraction of lr
(3e-3 here); 10 steps give observed differences up to ~5e-6. A real bug (a
missing reduction, a wrong weight-decay group, a stale shard) moves parameters
by ~lr per step, 300 times the tolerance.
"""
import torch

STEPS = 10
RTOL, ATOL = 1e-5, 1e-5
BASE = {
    "model": {"family": "gpt2", "size": "tiny"},
    "data": {"kind": "synthetic", "seq_len": 32, "vocab_size": 256, "branching": 4, "num_samples": 512,
             "eval_samples": 64, "seed": 0},
    "batch": {"global_batch": 16},
    "optimizer": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.1, "implementation": "torch"},
    "scheduler": {"type": "WarmupCosineLR", "warmup_num_steps": 3},
    # NOTE: device cpu, also on a GPU machine: the ranks are forked (CUDA cannot start in a forked child) and use gloo
    "training": {"device": "cpu", "max_steps": STEPS, "seed": 1234, "eval_interval": 0, "log_interval": 1,
                 "grad_clip": 0.5},
    "logging": {"console": False, "tensorboard": False, "wandb": {"mode": "disabled"}},
    "checkpoint": {"save_final": False},
}
# NOTE: a small reduce bucket, so the tiny model has several buckets and the in-order launch is exercised.
SMALL_BUCKETS = "zero.reduce_bucket_size=20000"


def tiny_engine(world, overrides):
    from toolkit.data.batches import BatchStream, Dataset
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import recipe_from_dict

    recipe = recipe_from_dict(BASE, overrides, world_size=world)
    engine = Engine(recipe)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=engine.dist.rank, seed=recipe.training.seed)
    return recipe, engine, stream


def train(world, overrides, steps=STEPS):
    """(engine, stream, losses, grad norms) after `steps` optimizer steps."""
    _, engine, stream = tiny_engine(world, overrides)
    results = [engine.train_batch(stream.next_step()) for _ in range(steps)]
    return engine, stream, [r.loss for r in results], [r.grad_norm for r in results]


def assert_stages_1_to_3_track_stage_0(overrides, moment_dtype, rel):
    """STEPS steps of `overrides` with small buckets at each ZeRO stage in one process: the shards' exp_avg in
    `moment_dtype`, stages 1-3's losses within `rel` of stage 0's, and stage 0 with a 10% larger lr outside it."""
    import pytest

    runs = {stage: train(1, [f"zero.stage={stage}", SMALL_BUCKETS, *overrides]) for stage in (0, 1, 2, 3)}
    stage0 = runs[0][2]
    other_lr = train(1, ["zero.stage=0", SMALL_BUCKETS, *overrides, "optimizer.lr=0.0033"])[2]
    assert other_lr != pytest.approx(stage0, rel=rel)
    for stage in (1, 2, 3):
        engine, _, losses, _ = runs[stage]
        assert all(p.optimizer.exp_avg.dtype == moment_dtype for p in engine.strategy.parts)
        assert losses == pytest.approx(stage0, rel=rel), stage


def assert_params_close(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def owned_states(engine):
    """Every (name, kind) piece the strategy saves (param, exp_avg, exp_avg_sq), cloned."""
    return {(name, kind): view.clone() for name, _, _, views in engine.strategy.owned_pieces()
            for kind, view in views.items()}


def train_and_save(world, overrides, run_dir, save_after):
    """STEPS optimizer steps of a fresh engine on this rank, a checkpoint into `run_dir` after step `save_after + 1`:
    (engine, losses, the states it owned when it saved)."""
    from toolkit.checkpoint.checkpointer import Checkpointer

    recipe, engine, stream = tiny_engine(world, overrides)
    checkpointer = Checkpointer(recipe, run_dir, engine, stream)
    losses, saved = [], None
    for step in range(STEPS):
        losses.append(engine.train_batch(stream.next_step()).loss)
        if step == save_after:
            checkpointer.save()
            saved = owned_states(engine)
    return engine, losses, saved


def fork_ranks(rank_main, world: int, *args) -> None:
    """`rank_main(rank, world, port, *args)` on `world` forked gloo ranks, waited for."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    # NOTE: forked ranks inherit the parent's imports (transformers, the engine): on a loaded 2-core machine a
    # spawned rank spent several seconds importing them, more than its training (test_zero_dist: 2 + 4 + 2 ranks).
    from transformers import GPT2LMHeadModel  # noqa: F401
    import toolkit.runtime.engine  # noqa: F401

    mp.start_processes(rank_main, args=(world, free_port(), *args), nprocs=world, join=True, start_method="fork")


def spawn_ranks(rank_main, world: int, result_file, *args) -> list:
    """`rank_main(rank, world, port, *args)` on `world` (forked) gloo ranks; then what each rank saved at
    `result_file(rank)`."""
    fork_ranks(rank_main, world, *args)
    return [torch.load(result_file(r), weights_only=False) for r in range(world)]


def save_and_resume(run_dir, saved_overrides, resumed_overrides, save_after=4):
    """Train STEPS steps saving after step `save_after + 1`; restore that checkpoint into a fresh engine of
    `resumed_overrides` and train to STEPS: (saved states, restored states, uninterrupted losses after the save,
    resumed losses, the fresh engine)."""
    from toolkit.checkpoint.checkpointer import restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    _, uninterrupted, saved = train_and_save(1, saved_overrides, run_dir, save_after)
    ckpt = load_checkpoint(find_checkpoint(run_dir))
    _, engine, stream = tiny_engine(1, resumed_overrides)
    restore_engine_and_stream(ckpt, engine, stream)
    restored = owned_states(engine)
    resumed = [engine.train_batch(stream.next_step()).loss for _ in range(STEPS - ckpt.step)]
    return saved, restored, uninterrupted[ckpt.step:], resumed, engine


def assert_offload_param_changes_nothing(overrides, tmp_path) -> dict:
    """Stage 3 with zero.offload_param cpu and nvme trains as with offload_param none, bit for bit: the same losses
    and final weights (`overrides` hold the state dtype and the optimizer's tier). The engines by tier."""
    base = ["zero.stage=3", SMALL_BUCKETS, *overrides, f"zero.nvme_path={tmp_path}"]
    runs = {tier: train(1, [*base, f"zero.offload_param={tier}"]) for tier in ("none", "cpu", "nvme")}
    want = runs["none"][0].strategy.full_parameters()
    for tier in ("cpu", "nvme"):
        engine, _, losses, _ = runs[tier]
        assert engine.strategy.weights.tier == tier
        assert losses == runs["none"][2], tier
        assert all(torch.equal(got, want[name]) for name, got in engine.strategy.full_parameters().items()), tier
    return {tier: run[0] for tier, run in runs.items()}


def assert_swap_files_change_nothing(overrides, tmp_path):
    """`overrides` with zero.offload_optimizer nvme trains as with cpu, bit for bit: the same losses and final weights.
    (the swapped engine's recipe, the engine, the estimate's tier bytes for it)."""
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.tiers import input_tiers

    in_memory = train(1, [*overrides, "zero.offload_optimizer=cpu"])
    recipe, engine, stream = tiny_engine(1, [*overrides, "zero.offload_optimizer=nvme", f"zero.nvme_path={tmp_path}"])
    losses = [engine.train_batch(stream.next_step()).loss for _ in range(len(in_memory[2]))]
    assert losses == in_memory[2]
    want = in_memory[0].strategy.full_parameters()
    assert all(torch.equal(got, want[name]) for name, got in engine.strategy.full_parameters().items())
    return recipe, engine, input_tiers(EstimateInput.from_recipe(recipe), num_params=engine.num_parameters)


# The delayed offloaded update (tests/runtime/test_delayed_offload.py, and on CUDA test_optimizer_layer_cuda.py)
WARMUP = 3
DELAYED = ["zero.offload_optimizer=cpu", "zero.offload_update=delayed", f"zero.offload_update_warmup={WARMUP}"]


def assert_the_repeated_clip_equals_copying_again(run: list[str], monkeypatch) -> None:
    """zero.offload_update delayed with every step clipped: the run whose thread repeats the clip on the backward's
    early gradient copies equals, in losses and weights bit for bit, the same run copying the clipped gradients again
    (as a 16-bit gradient shard does)."""
    from toolkit.runtime.zero import delayed_update

    def finished_run() -> tuple[list, list]:
        engine, _, losses, _ = train(1, run)
        engine.strategy.complete_pending_update()
        return losses, [p.detach().float().cpu() for p in engine.strategy.full_parameters().values()]

    repeated = finished_run()
    init = delayed_update.DelayedUpdate.__init__

    def copy_again(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.scale_on_host = False

    monkeypatch.setattr(delayed_update.DelayedUpdate, "__init__", copy_again)
    losses, params = finished_run()
    assert losses == repeated[0]
    assert all(torch.equal(a, b) for a, b in zip(params, repeated[1]))


def delayed_reference(warmup: int, steps: int = STEPS, delayed_names=None, extrapolate: bool = False, base=()):
    """(losses, final master weights by name) of the hand-written delayed rule on a stage-0 engine of `base`
    overrides; only the parameters in `delayed_names` are delayed (None: all). `extrapolate`
    (delayed_extrapolated): a forward whose previous update was delayed sees 2 M_{t-1} - M_{t-2}, not M_{t-1}."""
    previous = None
    _, engine, stream = tiny_engine(1, ["zero.stage=0", *base])
    params = dict(engine.model.named_parameters())
    master = {n: p.detach().clone() for n, p in params.items()}
    losses = []
    for t in range(1, steps + 1):
        for batch in stream.next_step():  # gradients at the weights the model holds: W
            engine.backward(engine(batch))
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(master[n])  # the optimizer steps the master
        losses.append(engine.step().loss)
        stepped = {n: p.detach().clone() for n, p in params.items()}
        if t > warmup:  # delayed: the next forward sees the master before this update
            with torch.no_grad():
                for n, p in params.items():
                    if delayed_names is None or n in delayed_names:
                        ahead = extrapolate and t - 1 > warmup  # the update that lands now was delayed
                        p.copy_(2 * master[n].double() - previous[n].double() if ahead else master[n])
        previous, master = master, stepped
    return losses, master


def _modes_rank_main(rank, world, port, out_dir, configs: dict, modes: dict) -> None:
    from tests.conftest import become_rank, leave_rank

    become_rank(rank, world, port)
    results = {}
    for name, overrides in configs.items():
        for mode, extra in modes.items():
            engine, _, losses, _ = train(world, overrides + extra)
            results[name, mode] = {"losses": losses, "params": engine.strategy.full_parameters()}
    torch.save(results, out_dir / f"rank{rank}.pt")
    leave_rank()


def assert_modes_bit_for_bit_on_two_ranks(out_dir, configs: dict, modes: dict) -> None:
    """Each config (name: overrides) trained STEPS steps in each of two modes (name: extra overrides) on 2 spawned
    gloo ranks: the second mode's losses and final parameters equal the first's on every rank."""
    first, second = modes
    for rank, results in enumerate(spawn_ranks(_modes_rank_main, 2, lambda r: out_dir / f"rank{r}.pt", out_dir,
                                               configs, modes)):
        for name in configs:
            a, b = results[name, first], results[name, second]
            assert len(a["losses"]) == STEPS and b["losses"] == a["losses"], (rank, name)
            assert all(torch.equal(b["params"][n], p) for n, p in a["params"].items()), (rank, name)
