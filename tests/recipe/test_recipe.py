"""Recipe loading and validation: every shipped recipe validates, every user
mistake fails with exit code 2 and one line per problem naming its JSON path
(through the real `toolkit validate`). How recipes compose (`extends`, overrides,
schema defaults, the hash, batch derivation): test_recipe_composition.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe.recipe_helpers import MINIMAL, recipe, with_key, write
from toolkit.cli.main import main as cli_main
from toolkit.recipe.load import RecipeError, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "recipes").glob("*.json"))

# Recipes whose name says they are for several GPUs, and the world size their batch is sized for.
MULTI_GPU_WORLD_SIZE = {"gpt2-medium-zero2": 8, "gpt2-1.5b-zero3": 8}

def run_validate_subprocess(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m toolkit validate ARGS` in a fresh interpreter, cwd a temporary directory."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "toolkit", "validate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------------
# Shipped recipes.


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_validates_on_one_rank(path):
    r = load_recipe(path, world_size=1)
    assert r.name == path.stem
    assert r.batch.world_size == 1
    assert r.batch.micro_batch_per_rank * r.batch.grad_accum_steps == r.batch.global_batch
    assert r.training.max_steps > r.scheduler.warmup_num_steps


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_has_schema_link_and_one_line_description(path):
    raw = json.loads(path.read_text())
    assert raw["$schema"] == "../schemas/recipe.schema.json"
    assert (path.parent / raw["$schema"]).resolve() == (REPO / "schemas" / "recipe.schema.json")
    assert raw["description"].strip() and "\n" not in raw["description"]


def test_every_multi_gpu_recipe_has_a_world_size_to_check():
    named_for_many_gpus = {p.stem for p in SHIPPED if "zero" in p.stem or "multi" in p.stem}
    assert named_for_many_gpus == set(MULTI_GPU_WORLD_SIZE)


@pytest.mark.parametrize("stem,world_size", sorted(MULTI_GPU_WORLD_SIZE.items()))
def test_multi_gpu_recipe_batch_triple_is_consistent_at_its_world_size(stem, world_size):
    r = load_recipe(REPO / "recipes" / f"{stem}.json", world_size=world_size)
    b = r.batch
    assert b.world_size == world_size
    assert b.micro_batch_per_rank * b.grad_accum_steps * world_size == b.global_batch
    assert r.zero.stage >= 2


def test_shipped_recipes_say_what_their_names_promise():
    gpt2 = load_recipe(REPO / "recipes" / "gpt2-124m.json")
    assert (gpt2.model.family, gpt2.model.size, gpt2.precision.dtype) == ("gpt2", "124m", "bf16")
    assert (gpt2.data.kind, gpt2.data.seq_len, gpt2.model.vocab_size) == ("synthetic", 1024, 50257)
    assert gpt2.scheduler.type == "WarmupCosineLR" and gpt2.zero.stage == 1  # 16-bit weights: faster on one GPU

    medium = load_recipe(REPO / "recipes" / "gpt2-medium-zero2.json", world_size=8)
    assert (medium.model.size, medium.zero.stage, medium.precision.dtype) == ("350m", 2, "fp16")
    assert (medium.batch.global_batch, medium.batch.micro_batch_per_rank, medium.batch.grad_accum_steps) == (256, 8, 4)

    xl = load_recipe(REPO / "recipes" / "gpt2-1.5b-zero3.json", world_size=8)
    assert (xl.model.size, xl.zero.stage, xl.zero.offload_optimizer, xl.precision.dtype) == ("1.5b", 3, "cpu", "bf16")
    assert xl.model.activation_checkpointing is True

    llama = load_recipe(REPO / "recipes" / "llama-1b.json")
    assert (llama.model.family, llama.model.size, llama.precision.dtype) == ("llama", "1b", "bf16")
    assert llama.model.vocab_size == 32000 and llama.model.n_kv_head == 4


def test_cli_validates_zero2_recipe_for_eight_ranks_and_prints_the_batch_arithmetic(tmp_path):
    proc = run_validate_subprocess(tmp_path, str(REPO / "recipes" / "gpt2-medium-zero2.json"), "--world-size", "8")
    assert proc.returncode == 0, proc.stderr
    assert "global batch 256 = micro 8 x accum 4 x world 8" in proc.stdout
    # an fp16 recipe validated where no NVIDIA driver shows: a warning that `run` would refuse it here, and on a
    # small host one that eight ranks of it do not fit this machine (tests/train/test_preflight.py)
    warned = ("warning: recipe.precision.dtype: 'fp16' needs a CUDA", "warning: recipe: too big for this machine")
    assert all(line.startswith(warned) for line in proc.stderr.splitlines()), proc.stderr


def test_cli_finds_a_shipped_recipe_by_name_from_any_directory(tmp_path):
    proc = run_validate_subprocess(tmp_path, "quickstart")
    assert proc.returncode == 0, proc.stderr
    assert "quickstart: valid" in proc.stdout


# ---------------------------------------------------------------------------
# Invalid recipes: exit code 2, one line per problem naming its JSON path, no traceback.

CYCLE = {"a.json": {"extends": "b.json", **MINIMAL}, "b.json": {"extends": "a.json"}}
MALFORMED = '{\n  "model": {"family": "gpt2",}\n}\n'
LEVELS = ["", "model", "data", "batch", "precision", "precision.fp16", "zero", "optimizer", "scheduler",
          "training", "logging", "logging.wandb", "checkpoint", "kernels"]


def _unknown_key_case(level: str):
    path = f"recipe.{level}.bogus_key" if level else "recipe.bogus_key"
    content = {**recipe(), "bogus_key": 1} if not level else with_key(level, "bogus_key", 1)
    return pytest.param(content, [], [f"{path}: unknown key"], id=f"unknown-key-{level or 'top'}")


# (recipe.json content or {file: content}, extra CLI args, substrings stderr must contain).
# Cases whose id ends in "-cli" run through a real subprocess; the rest through toolkit.cli.main.main.
INVALID = [
    *[_unknown_key_case(level) for level in LEVELS],
    # Misspellings get a did-you-mean.
    pytest.param(with_key("model", "n_layr", 2), [], ["recipe.model.n_layr: unknown key; did you mean 'n_layer'?"],
                 id="misspelled-model-key-cli"),
    pytest.param({**{k: v for k, v in recipe().items() if k != "training"}, "trainig": {"max_steps": 5}}, [],
                 ["recipe.trainig: unknown key; did you mean 'training'?", "recipe.training: required, missing"],
                 id="misspelled-top-level-section"),
    pytest.param(recipe(training={"max_step": 5}), [],
                 ["recipe.training.max_step: unknown key; did you mean 'max_steps'?",
                  "recipe.training: give exactly one of max_steps or epochs"], id="misspelled-max-steps"),
    # Wrong types.
    pytest.param(recipe(data={**MINIMAL["data"], "seq_len": "32"}), [], ['recipe.data.seq_len: "32" is not an integer'],
                 id="string-for-integer"),
    pytest.param(with_key("optimizer", "lr", "3e-4"), [], ['recipe.optimizer.lr: "3e-4" is not a number'],
                 id="string-for-number"),
    pytest.param(with_key("logging", "tensorboard", "yes"), [],
                 ['recipe.logging.tensorboard: "yes" is not true or false'], id="string-for-boolean"),
    pytest.param(recipe(training={"max_steps": True}), [], ["recipe.training.max_steps: true is not an integer"],
                 id="boolean-for-integer"),
    pytest.param(with_key("optimizer", "betas", 0.9), [], ["recipe.optimizer.betas: 0.9 is not a list"],
                 id="number-for-list"),
    pytest.param(recipe(model="gpt2"), [], ['recipe.model: "gpt2" is not an object'], id="string-for-section"),
    # Out of range.
    pytest.param(with_key("optimizer", "lr", 0), [], ["recipe.optimizer.lr: 0 is less than or equal to the minimum of 0"],
                 id="lr-zero"),
    pytest.param(with_key("model", "dropout", 1.5), [], ["recipe.model.dropout: 1.5 is greater than the maximum of 1"],
                 id="dropout-above-one"),
    pytest.param(with_key("optimizer", "betas", [0.9, 1.0]), [], ["recipe.optimizer.betas[1]: 1.0 is greater than"],
                 id="beta2-one"),
    pytest.param(recipe(batch={"micro_batch_per_rank": 0}), [], ["recipe.batch.micro_batch_per_rank: 0 is less than"],
                 id="micro-batch-zero"),
    pytest.param(with_key("precision.fp16", "initial_scale_power", 65), [],
                 ["recipe.precision.fp16.initial_scale_power: 65 is greater than the maximum of 64"],
                 id="scale-power-too-big"),
    pytest.param(recipe(name="my run"), [], ["recipe.name: 'my run' does not match"], id="name-with-space"),
    pytest.param('{"model": {"family": "gpt2"}, "data": {}, "batch": {"micro_batch_per_rank": 4},'
                 ' "training": {"max_steps": 20}, "optimizer": {"lr": NaN}}', [],
                 ["recipe.optimizer.lr: NaN is not a finite number"], id="nan-learning-rate"),
    # Bad enums.
    pytest.param(with_key("zero", "stage", 4), [], ["recipe.zero.stage: 4 is not one of [0, 1, 2, 3]"],
                 id="zero-stage-4-cli"),
    pytest.param(with_key("precision", "dtype", "fp8"), [],
                 ['recipe.precision.dtype: "fp8" is not one of ["fp32", "bf16", "fp16"]'], id="dtype-fp8"),
    pytest.param(with_key("scheduler", "type", "WarmupCosine"), [],
                 ['recipe.scheduler.type: "WarmupCosine" is not one of ["constant", "WarmupLR", "WarmupDecayLR", '
                  '"WarmupCosineLR", "OneCycle", "LRRangeTest"]; did you mean \'WarmupCosineLR\'?'], id="scheduler-type-misspelled"),
    pytest.param(recipe(model={"family": "gpt2", "size": "1b"}), [],
                 ['recipe.model.size: "1b" is not one of ["tiny", "124m", "350m", "774m", "1.5b"] (sizes of family gpt2)'],
                 id="gpt2-with-llama-size"),
    pytest.param(recipe(model={"size": "60m"}), [],
                 ['recipe.model.size: "60m" is not one of ["tiny", "124m", "350m", "774m", "1.5b"] (sizes of family gpt2)'],
                 id="default-family-gpt2-with-llama-size"),
    pytest.param(recipe(model={"family": "llama", "size": "124m"}), [],
                 ['recipe.model.size: "124m" is not one of ["tiny", "60m", "250m", "1b"] (sizes of family llama)'],
                 id="llama-with-gpt2-size"),
    pytest.param(recipe(model={"family": "gpt2", "size": "tiny", "n_kv_head": 2}), [],
                 ["recipe.model.n_kv_head: only llama models have this key (family is gpt2)"], id="llama-key-on-gpt2"),
    # Batch sizes.
    pytest.param(recipe(batch={"micro_batch_per_rank": 4, "grad_accum_steps": 2, "global_batch": 64}), [],
                 ["recipe.batch: global_batch 64 != micro_batch_per_rank 4 x grad_accum_steps 2 x world size 1 = 8; set "
                  "batch.grad_accum_steps to 16 or batch.micro_batch_per_rank to 32 to keep the global batch, or "
                  "batch.global_batch to 8"],
                 id="inconsistent-batch-triple-cli"),
    pytest.param(recipe(batch={"micro_batch_per_rank": 4, "global_batch": 10}), [],
                 ["recipe.batch: global_batch 10 is not divisible by micro_batch_per_rank 4 x world size 1 = 4; set "
                  "batch.micro_batch_per_rank to 2 to keep the global batch, or batch.global_batch to 8 or 12"],
                 id="global-not-divisible-by-micro"),
    pytest.param(recipe(batch={"global_batch": 6}), ["--world-size", "4"],
                 ["recipe.batch: global_batch 6 is not divisible by world size 4; set batch.global_batch to 4 or 8"], id="global-not-divisible-by-world"),
    pytest.param(recipe(batch={"grad_accum_steps": 2}), [],
                 ["recipe.batch: give micro_batch_per_rank or global_batch (or both)"], id="batch-without-sizes"),
    pytest.param(recipe(), ["--world-size", "0"], ["world size: 0 must be a positive integer"], id="world-size-zero"),
    # Cross-section rules.
    pytest.param(recipe(zero={"stage": 0, "offload_optimizer": "cpu"}), [],
                 ["recipe.zero.offload_optimizer: 'cpu' needs zero.stage >= 1 (stage is 0)"], id="offload-with-stage-0"),
    pytest.param(recipe(zero={"stage": 2, "offload_ratio": 0.5}), [],
                 ["recipe.zero.offload_ratio: 0.5 needs zero.offload_optimizer 'cpu' (it is the part of the "
                  "optimizer kept in CPU memory)"], id="offload-ratio-without-offload"),
    pytest.param(recipe(zero={"stage": 2, "offload_optimizer": "cpu", "offload_ratio": 0}), [],
                 ["recipe.zero.offload_ratio: 0 is less than or equal to the minimum of 0"], id="offload-ratio-zero"),
    pytest.param(recipe(training={"max_steps": 10, "epochs": 1}), [],
                 ["recipe.training: give exactly one of max_steps or epochs"], id="both-max-steps-and-epochs"),
    pytest.param(recipe(training={"seed": 1}), [], ["recipe.training: give exactly one of max_steps or epochs"],
                 id="neither-max-steps-nor-epochs"),
    pytest.param({k: v for k, v in recipe().items() if k != "data"}, [], ["recipe.data: required, missing"],
                 id="missing-data-section"),
    # Files.
    pytest.param(MALFORMED, [], ["recipe.json:2:30: malformed JSON: Expecting property name enclosed in double quotes"],
                 id="malformed-json-cli"),
    pytest.param("", [], ["recipe.json: empty file, expected a JSON object"], id="empty-file-cli"),
    pytest.param(None, [], ["recipe.json: recipe file not found"], id="missing-file-cli"),
    pytest.param("[1, 2]", [], ["recipe.json: expected a JSON object at the top level, got array"],
                 id="top-level-list-cli"),
    pytest.param('{"model": {"size": "tiny", "size": "124m"}}', [],
                 ["recipe.json: recipe.model.size: duplicate key"], id="duplicate-key"),
    pytest.param({"recipe.json": {"extends": "a.json"}, **CYCLE}, [],
                 ["recipe.extends: cycle recipe.json -> a.json -> b.json -> a.json"], id="cyclic-extends-cli"),
    pytest.param({**recipe(), "extends": "missing.json"}, [],
                 ["recipe.json: recipe.extends: missing.json: file not found"], id="extends-missing-file-cli"),
    pytest.param({**recipe(), "extends": 5}, [], ["recipe.extends: 5 is not a path string"], id="extends-not-a-string"),
    # Overrides.
    pytest.param(recipe(), ["optimizer.lr"], ["override 'optimizer.lr': expected key.path=value"],
                 id="override-without-equals-cli"),
    pytest.param(recipe(), ["optimizer.weight_decy=0.1"],
                 ["recipe.optimizer.weight_decy: unknown key; did you mean 'weight_decay'? "
                  "(override 'optimizer.weight_decy=0.1')"],
                 id="override-unknown-key-cli"),
    pytest.param(recipe(), ["training.max_steps=ten"],
                 ["recipe.training.max_steps: 'ten' is not an integer (override 'training.max_steps=ten')"],
                 id="override-wrong-type-cli"),
    pytest.param(recipe(), ["optimizer.lr=[1]"], ["recipe.optimizer.lr: [1] is not a number"],
                 id="override-json-of-wrong-type"),
    pytest.param(recipe(), ["logging.console=yes"], ["recipe.logging.console: 'yes' is not true or false"],
                 id="override-bad-boolean"),
    pytest.param(recipe(), ["model.size.layers=2"], ["recipe.model.size: is not an object"],
                 id="override-below-a-leaf"),
    pytest.param(recipe(), ["extends=other.json"], ["recipe.extends: cannot be overridden"], id="override-extends"),
]


@pytest.mark.parametrize("content,args,expected", INVALID)
def test_invalid_recipe_exits_2_with_one_line_naming_its_path(content, args, expected, tmp_path, capsys, monkeypatch,
                                                             request):
    files = content if isinstance(content, dict) and "recipe.json" in content else {"recipe.json": content}
    for name, text in files.items():
        if text is not None:
            write(tmp_path / name, text)
    argv = ["recipe.json", *args]
    if request.node.callspec.id.endswith("-cli"):
        proc = run_validate_subprocess(tmp_path, *argv)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        code = cli_main(["validate", *argv])
        out, err = capsys.readouterr()
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == len(expected), err      # one line per problem, nothing repeated
    assert all(line.startswith("error: ") for line in lines), err
    for wanted in expected:
        assert any(wanted in line for line in lines), err


def test_invalid_table_is_large_and_runs_enough_through_a_real_subprocess():
    ids = [p.id for p in INVALID]
    assert len(ids) >= 35 and len(set(ids)) == len(ids)
    assert sum(i.endswith("-cli") for i in ids) >= 10


def test_unknown_key_at_every_level_names_its_path(tmp_path):
    # All fourteen at once: validation collects every problem before it stops.
    content = recipe()
    content["bogus_key"] = 1
    for level in LEVELS[1:]:
        node = content
        for part in level.split("."):
            node = node.setdefault(part, {})
        node["bogus_key"] = 1
    proc = run_validate_subprocess(tmp_path, str(write(tmp_path / "recipe.json", content)))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    reported = [line.removeprefix("error: ").split(":")[0] for line in lines]
    assert sorted(reported) == sorted(f"recipe.{lv}.bogus_key" if lv else "recipe.bogus_key" for lv in LEVELS)
    assert all(": unknown key (expected one of: " in line for line in lines), proc.stderr


def test_errors_are_reported_in_the_order_the_recipe_is_written():
    bad = {"training": {"max_steps": 0}, "model": {"n_layer": 0}, "data": {"seq_len": 1},
           "batch": {"micro_batch_per_rank": 4}}
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(bad)
    assert [line.split(":")[0] for line in info.value.lines] == [
        "recipe.training.max_steps", "recipe.model.n_layer", "recipe.data.seq_len"]




@pytest.mark.parametrize("batch", [
    {"micro_batch_per_rank": 4, "grad_accum_steps": 4, "global_batch": 16},
    {"micro_batch_per_rank": 3, "grad_accum_steps": 5, "global_batch": 24},
    {"micro_batch_per_rank": 16, "grad_accum_steps": 1, "global_batch": 16},
    {"micro_batch_per_rank": 6, "global_batch": 20},
    {"micro_batch_per_rank": 5, "global_batch": 21},
    {"grad_accum_steps": 3, "global_batch": 16},
    {"global_batch": 15},
], ids=lambda b: "-".join(f"{k.split('_')[0]}{v}" for k, v in b.items()))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_fix_a_batch_error_names_resolves_the_batch(batch, world):
    from toolkit.recipe.assemble import resolve_batch

    spec, errors = resolve_batch(batch, world)
    if not errors:
        return
    fixes = re.findall(r"batch\.(\w+) to (\d+(?: or \d+)?)", errors[0])
    assert fixes, errors
    for key, values in fixes:
        for value in values.split(" or "):
            fixed, again = resolve_batch({**batch, key: int(value)}, world)
            assert again == [], (errors[0], key, value, again)
            if key != "global_batch":  # the fixes that keep the global batch do keep it
                assert fixed.global_batch == batch["global_batch"], (errors[0], key, value)
