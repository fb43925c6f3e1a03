"""The dry run (toolkit/train/dry_run.py): one rank of a 64-rank job on torch's fake process group, in this
process. Its model-state bytes, counted from live tensors, equal the estimate at the engine's layout exactly
and the estimate at the model's parameter count within the engine's padding; its bytes on the wire per step
equal the ZeRO traffic formulas. Plus the CLI (`toolkit estimate --dry-run`), its user errors and a mismatch."""
import dataclasses

import pytest

from tests.conftest import run_cli

WORLD = 64


def _report(world, *overrides, steps=2, rank=0):
    from toolkit.recipe.load import load_recipe
    from toolkit.train.dry_run import dry_run

    recipe = load_recipe("quickstart", ["batch.micro_batch_per_rank=4", "training.device=cpu", *overrides],
                         world_size=world)
    return dry_run(recipe, rank=rank, steps=steps)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dry_run_at_64_ranks_holds_the_estimate_and_the_comm_formulas(stage):
    report = _report(WORLD, f"zero.stage={stage}")
    assert report.mismatches() == []
    # exactly the estimate at the engine's layout (its padding, stage 0's AdamW step counters)
    assert report.measured == report.estimated_padded
    # and the estimate `toolkit estimate` prints, within the padding: each group pads fewer than N elements,
    # each padded element costing at most 4 + 4 + 12 bytes (parameter, gradient, master and moments)
    padding = report.groups * (WORLD - 1)
    assert report.padded_numel - report.num_params <= padding
    assert 0 <= sum(report.measured.values()) - sum(report.estimated.values()) <= 20 * padding + 4 * 64
    # every step sent the formula's bytes (the few scalar all-reduces aside)
    assert len(report.comm_steps) == 2 and report.comm_measured == report.comm_expected
    if stage == 3:  # the rank really holds 1/N of the parameters
        assert report.measured["params"] == 4 * report.padded_numel // WORLD


@pytest.mark.parametrize("world", [8, 512])
def test_dry_run_stage3_with_cpu_offload_at_8_and_512_ranks(world):
    report = _report(world, "zero.stage=3", "zero.offload_optimizer=cpu", "batch.grad_accum_steps=2", rank=world - 1)
    assert report.mismatches() == []
    assert report.measured["host"] == report.estimated_padded["host"] > 0
    from toolkit.observe.comm_ledger import wire_bytes

    # stage 3 reduce-scatters every micro-step: twice Ψ's (n-1)/n per step at grad_accum_steps 2
    assert report.comm_measured == report.comm_expected
    assert report.comm_expected["reduce_scatter"] == 2 * wire_bytes("reduce_scatter", 4 * report.padded_numel, world)


def test_a_mismatch_is_reported_and_exits_1(monkeypatch, capsys):
    from toolkit.recipe.load import load_recipe
    from toolkit.train import dry_run as module

    good = _report(8, "zero.stage=2", steps=1)
    broken = dataclasses.replace(good, measured={**good.measured, "grads": good.measured["grads"] + 4},
                                 comm_steps=[{**good.comm_steps[0], "all_gather": 1}])
    lines = broken.mismatches()
    assert any(line.startswith("model states grads") for line in lines)
    assert any(line.startswith("comm step 1") for line in lines)
    monkeypatch.setattr(module, "dry_run", lambda recipe, rank, steps: broken)
    recipe = load_recipe("quickstart", ["zero.stage=2"], world_size=8)
    assert module.dry_run_command(recipe, rank=0, steps=1) == 1
    assert "MISMATCH: model states grads" in capsys.readouterr().err


def test_cli_dry_run_at_64_ranks_exits_0():
    proc = run_cli("estimate", "quickstart", "--world-size", "64", "--dry-run", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0 of 64 on torch's fake process group" in proc.stdout
    assert "MISMATCH" not in proc.stderr and " NO" not in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--world-size", "1", "--dry-run"], "--world-size 1: the dry run builds one rank of a job with several"),
    (["--world-size", "48", "--dry-run", "batch.global_batch=100"], "recipe.batch: global_batch 100"),
    (["--world-size", "8", "--dry-run", "--rank", "8"], "--rank 8: not a rank of a 8-rank job"),
    (["--world-size", "8", "--steps", "2"], "--rank and --steps go with --dry-run"),
])
def test_dry_run_user_mistakes_are_one_line_exit_2(args, message):
    proc = run_cli("estimate", "quickstart", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
