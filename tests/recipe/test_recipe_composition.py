"""How recipes compose: `extends`, overrides typed by the schema, schema defaults, the recipe hash and
batch derivation behave as documented."""
from __future__ import annotations

import json
import os

import pytest

from tests.recipe.recipe_helpers import MINIMAL, recipe, write
from toolkit.recipe.load import RecipeError, load_recipe, load_schema, recipe_from_dict


# ---------------------------------------------------------------------------
# extends.


def test_extends_merges_objects_and_replaces_lists(tmp_path):
    write(tmp_path / "base.json", recipe(optimizer={"lr": 0.002, "betas": [0.9, 0.999], "weight_decay": 0.0}))
    child = write(tmp_path / "child.json", {"extends": "base.json", "optimizer": {"betas": [0.8, 0.9]},
                                            "model": {"size": "124m"}})
    r = load_recipe(child)
    assert r.optimizer.betas == (0.8, 0.9)       # the list replaced, not concatenated
    assert r.optimizer.lr == 0.002               # sibling keys of the base survive the merge
    assert r.optimizer.weight_decay == 0.0
    assert (r.model.family, r.model.size) == ("gpt2", "124m")
    assert r.training.max_steps == 20            # whole sections only the base has are kept
    assert r.name == "child"


def test_extends_path_is_relative_to_the_extending_file_not_the_cwd(tmp_path, monkeypatch):
    write(tmp_path / "shared" / "base.json", recipe(training={"max_steps": 7}, scheduler={"type": "constant"}))
    write(tmp_path / "shared" / "mid.json", {"extends": "base.json", "optimizer": {"lr": 0.01}})
    run = write(tmp_path / "runs" / "exp" / "run.json", {"extends": "../../shared/mid.json", "zero": {"stage": 1}})
    write(tmp_path / "elsewhere" / "base.json", recipe(training={"max_steps": 999}))  # a decoy in the cwd
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = load_recipe(os.path.relpath(run))
    assert (r.training.max_steps, r.optimizer.lr, r.zero.stage) == (7, 0.01, 1)


def test_overrides_win_over_the_extending_file_which_wins_over_its_base(tmp_path):
    write(tmp_path / "base.json", recipe(optimizer={"lr": 0.001, "weight_decay": 0.2}))
    child = write(tmp_path / "child.json", {"extends": "base.json", "optimizer": {"lr": 0.002}})
    r = load_recipe(child, ["optimizer.weight_decay=0.3"])
    assert (r.optimizer.lr, r.optimizer.weight_decay) == (0.002, 0.3)


def test_extends_cycle_of_one_file_is_reported(tmp_path):
    path = write(tmp_path / "self.json", {"extends": "self.json", **MINIMAL})
    with pytest.raises(RecipeError, match=r"recipe\.extends: cycle self\.json -> self\.json"):
        load_recipe(path)


# ---------------------------------------------------------------------------
# Overrides typed by the schema.


def test_overrides_are_typed_by_the_schema(tmp_path):
    path = write(tmp_path / "r.json", recipe())
    r = load_recipe(path, ["training.max_steps=50", "optimizer.lr=3e-4", "logging.tensorboard=true",
                           "optimizer.betas=[0.9,0.95]", "precision.dtype=fp16", "zero.stage=1",
                           "name=2024", "model.size=124m", "precision.fp16.consecutive_hysteresis=false"])
    assert r.training.max_steps == 50 and type(r.training.max_steps) is int
    assert r.optimizer.lr == 3e-4 and type(r.optimizer.lr) is float
    assert r.logging.tensorboard is True
    assert r.optimizer.betas == (0.9, 0.95)
    assert r.precision.dtype == "fp16"
    assert r.zero.stage == 1 and type(r.zero.stage) is int
    assert r.name == "2024"                      # a string field is never parsed as JSON
    assert r.model.size == "124m"
    assert r.precision.fp16.consecutive_hysteresis is False


def test_override_creates_a_section_the_file_does_not_have(tmp_path):
    path = write(tmp_path / "r.json", recipe())
    r = load_recipe(path, ["logging.wandb.mode=offline", "kernels.adamw=off"])
    assert r.logging.wandb.mode == "offline" and r.kernels.adamw == "off"


def test_all_override_errors_are_reported_together(tmp_path):
    path = write(tmp_path / "r.json", recipe())
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["optimizer.lrr=1", "training.max_steps=x", "nonsense"])
    assert len(info.value.lines) == 3


# ---------------------------------------------------------------------------
# Defaults from the schema.


def _schema_defaults(node: dict, parts=()):
    for key, sub in node.get("properties", {}).items():
        if "default" in sub:
            yield (*parts, key), sub["default"]
        if sub.get("type") == "object":
            yield from _schema_defaults(sub, (*parts, key))


def test_defaults_are_filled_from_the_schema():
    r = recipe_from_dict(recipe())
    assert r.optimizer.eps == 1e-8
    assert r.optimizer.betas == (0.9, 0.999)
    assert (r.zero.stage, r.precision.dtype, r.scheduler.type) == (0, "fp32", "constant")
    assert r.precision.fp16.initial_scale_power == 16
    assert r.logging.wandb.mode == "disabled" and r.logging.wandb.run_name is None
    assert r.batch.grad_accum_steps == 1
    assert r.model.max_positions == 32           # defaults to data.seq_len
    assert r.scheduler.total_num_steps == 20     # defaults to the run's optimizer steps


def test_every_schema_default_reaches_the_resolved_recipe():
    resolved = recipe_from_dict({"batch": {"micro_batch_per_rank": 4}, "model": {}, "data": {},
                                 "training": {"max_steps": 20}}).resolved
    defaults = list(_schema_defaults(load_schema()))
    assert len(defaults) > 50
    for path, default in defaults:
        node = resolved
        for part in path:
            node = node[part]
        assert node == default, ".".join(path)


def test_integral_float_is_read_as_an_integer():
    r = recipe_from_dict(recipe(batch={"micro_batch_per_rank": 4.0}, training={"max_steps": 20.0}))
    assert type(r.batch.micro_batch_per_rank) is int and type(r.batch.global_batch) is int
    assert type(r.training.max_steps) is int


def test_pretrained_folder_without_size_is_accepted_and_with_size_is_not(tmp_path):
    write(tmp_path / "hf" / "config.json", {"model_type": "gpt2"})
    ok = write(tmp_path / "ok.json", recipe(model={"pretrained": "hf"}))
    assert load_recipe(ok).model.pretrained == tmp_path / "hf"
    clash = write(tmp_path / "clash.json", recipe(model={"pretrained": "hf", "size": "124m"}))
    with pytest.raises(RecipeError, match=r"recipe\.model\.pretrained: excludes size"):
        load_recipe(clash)


def test_recipe_file_with_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(recipe()).encode())
    assert load_recipe(path).training.max_steps == 20


# ---------------------------------------------------------------------------
# The recipe hash.


def test_recipe_hash_is_stable_for_identical_inputs(tmp_path):
    a = write(tmp_path / "a.json", recipe())
    b = write(tmp_path / "b" / "a.json", json.dumps(dict(reversed(list(recipe().items())))))  # other key order
    hashes = {load_recipe(a).hash, load_recipe(a).hash, load_recipe(b).hash, recipe_from_dict(recipe()).hash,
              recipe_from_dict(recipe(), ["optimizer.eps=1e-8"]).hash}  # the default, written out
    assert len(hashes) == 1
    assert len(hashes.pop()) == 12


@pytest.mark.parametrize("override", ["optimizer.lr=0.002", "training.max_steps=21", "zero.stage=1",
                                      "data.seed=1", "precision.dtype=bf16"])
def test_recipe_hash_changes_when_a_value_changes(override):
    assert recipe_from_dict(recipe(), [override]).hash != recipe_from_dict(recipe()).hash


# ---------------------------------------------------------------------------
# Batch derivation: any two (or one) of micro / accum / global, per world size.


@pytest.mark.parametrize("given,world_size,expected", [
    ({"micro_batch_per_rank": 4, "grad_accum_steps": 2}, 1, (4, 2, 8)),
    ({"micro_batch_per_rank": 4, "grad_accum_steps": 2}, 2, (4, 2, 16)),
    ({"micro_batch_per_rank": 4, "grad_accum_steps": 2}, 4, (4, 2, 32)),
    ({"micro_batch_per_rank": 4, "global_batch": 32}, 2, (4, 4, 32)),
    ({"micro_batch_per_rank": 4, "global_batch": 32}, 4, (4, 2, 32)),
    ({"grad_accum_steps": 2, "global_batch": 32}, 2, (8, 2, 32)),
    ({"grad_accum_steps": 2, "global_batch": 32}, 4, (4, 2, 32)),
    ({"global_batch": 32}, 4, (8, 1, 32)),
    ({"micro_batch_per_rank": 4}, 2, (4, 1, 8)),
    ({"micro_batch_per_rank": 2, "grad_accum_steps": 2, "global_batch": 16}, 4, (2, 2, 16)),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else str(v))
def test_batch_triple_is_derived_from_what_is_given(given, world_size, expected):
    b = recipe_from_dict(recipe(batch=given), world_size=world_size).batch
    assert (b.micro_batch_per_rank, b.grad_accum_steps, b.global_batch, b.world_size) == (*expected, world_size)


def test_world_size_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert recipe_from_dict(recipe(batch={"global_batch": 32})).batch.micro_batch_per_rank == 8
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(RecipeError, match="WORLD_SIZE: 'four' is not an integer"):
        recipe_from_dict(recipe())


def test_epochs_set_the_number_of_steps():
    r = recipe_from_dict(recipe(training={"epochs": 1.5}, batch={"global_batch": 64}), world_size=2)
    assert r.training.max_steps == 6             # ceil(1.5 * 256 samples / 64)
