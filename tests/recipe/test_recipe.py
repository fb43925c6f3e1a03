"""Recipe loading and validation: every shipped recipe validates, every user
mistake fails with exit code 2 and one line per problem naming its JSON path
(through the real `toolkit validate`), and `extends`, overrides, schema
defaults, the recipe hash and batch derivation behave as documented.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cli.main import main as cli_main
from toolkit.recipe.load import RecipeError, load_recipe, load_schema, recipe_from_dict

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "recipes").glob("*.json"))

# Recipes whose name says they are for several GPUs, and the world size their batch is sized for.
MULTI_GPU_WORLD_SIZE = {"gpt2-medium-zero2": 8, "gpt2-1.5b-zero3": 8}

MINIMAL = {
    "model": {"family": "gpt2", "size": "tiny"},
    "data": {"kind": "synthetic", "seq_len": 32, "vocab_size": 64, "num_samples": 256, "eval_samples": 32},
    "batch": {"micro_batch_per_rank": 4},
    "training": {"max_steps": 20},
}


def recipe(**sections) -> dict:
    """MINIMAL with whole sections replaced (or added)."""
    return {**json.loads(json.dumps(MINIMAL)), **sections}


def with_key(section: str, key: str, value) -> dict:
    """MINIMAL with one key added inside a (dotted) section, creating the section if needed."""
    out = recipe()
    node = out
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[key] = value
    return out


def write(path: Path, content) -> Path:
    """Write a recipe (dict -> JSON, str -> as is) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return path


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
    assert gpt2.scheduler.type == "WarmupCosineLR" and gpt2.zero.stage == 0

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
    # an fp16 recipe validated where no NVIDIA driver shows: one warning that `run` would refuse it here
    assert proc.stderr == "" or (proc.stderr.startswith("warning: recipe.precision.dtype: 'fp16' needs a CUDA")
                                 and proc.stderr.count("\n") == 1)


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
                  '"WarmupCosineLR"]; did you mean \'WarmupCosineLR\'?'], id="scheduler-type-misspelled"),
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
                 ["recipe.batch: global_batch 64 != micro_batch_per_rank 4 * grad_accum_steps 2 * world_size 1 = 8"],
                 id="inconsistent-batch-triple-cli"),
    pytest.param(recipe(batch={"micro_batch_per_rank": 4, "global_batch": 10}), [],
                 ["recipe.batch: global_batch 10 is not divisible by micro_batch_per_rank 4 * world_size 1 = 4"],
                 id="global-not-divisible-by-micro"),
    pytest.param(recipe(batch={"global_batch": 6}), ["--world-size", "4"],
                 ["recipe.batch: global_batch 6 is not divisible by world_size 4"], id="global-not-divisible-by-world"),
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
