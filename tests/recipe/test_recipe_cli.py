"""First contact through the real CLI: `toolkit --version`, short trial runs of shipped
recipes (warnings, not errors), a run's own recipe.json rerunning as it stands, and
overrides that switch between mutually exclusive keys (`key=null`, one of a pair clears the other).
"""
from __future__ import annotations

import json
import platform

import pytest

import toolkit
from tests.conftest import REPO, run_cli
from toolkit.recipe.load import load_recipe


def test_version_flag_prints_the_version_and_doctor_starts_with_it():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"toolkit {toolkit.__version__} from {REPO / 'toolkit'} (python {platform.python_version()})\n"
    doctor = run_cli("doctor")
    assert doctor.returncode == 0, doctor.stderr
    assert doctor.stdout.splitlines()[0] == proc.stdout.strip()


@pytest.fixture(scope="module")
def short_quickstart_run(tmp_path_factory):
    """`toolkit run quickstart training.max_steps=3`: shorter than the recipe's 20 warmup steps."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    proc = run_cli("run", "quickstart", "training.max_steps=3", "training.eval_batches=1", "training.log_interval=1",
                   "logging.console=false",
                   "--run-dir", str(run_dir))
    return run_dir, proc


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: recipe.")]


def test_trial_run_shorter_than_the_warmup_runs_with_one_warning(short_quickstart_run):
    run_dir, proc = short_quickstart_run
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert _warnings(proc.stderr) == [
        "warning: recipe.scheduler.warmup_num_steps: 20 is not shorter than the run (3 optimizer steps): the schedule "
        "is cut at the run's end, still warming up (the lr never reaches 0.003)"]
    lrs = [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"lr"' in line]
    assert lrs == sorted(lrs) and len(lrs) == 3 and lrs[-1] < 0.003 / 5  # still climbing at the end
    validate = run_cli("validate", "quickstart", "training.max_steps=3", "training.log_interval=1")
    assert validate.returncode == 0 and _warnings(validate.stderr) == _warnings(proc.stderr), validate.stderr


def test_a_runs_own_recipe_json_validates_and_reruns_to_the_same_losses(short_quickstart_run, tmp_path):
    run_dir, first = short_quickstart_run
    assert first.returncode == 0, first.stderr
    written = json.loads((run_dir / "recipe.json").read_text())
    validate = run_cli("validate", str(run_dir / "recipe.json"))
    assert validate.returncode == 0, validate.stderr
    assert f"(hash {written['recipe_hash']})" in validate.stdout  # the hash it ran under
    rerun = run_cli("run", str(run_dir / "recipe.json"), "--run-dir", str(tmp_path / "again"))
    assert rerun.returncode == 0, rerun.stderr
    assert written["logging"]["console"] is False and rerun.stdout == ""  # no table, progress or summary
    assert _losses(tmp_path / "again") == _losses(run_dir)
    assert json.loads((tmp_path / "again" / "recipe.json").read_text()) == written  # a fixed point


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_edited_recipe_json_warns_that_its_hash_is_stale(short_quickstart_run, tmp_path):
    run_dir, _ = short_quickstart_run
    written = json.loads((run_dir / "recipe.json").read_text())
    written["optimizer"]["lr"] = 0.001
    (tmp_path / "recipe.json").write_text(json.dumps(written))
    proc = run_cli("validate", str(tmp_path / "recipe.json"))
    assert proc.returncode == 0, proc.stderr
    assert f"warning: recipe.recipe_hash: {written['recipe_hash']} is not this recipe's hash" in proc.stderr
    refused = run_cli("validate", "quickstart", "recipe_hash=0123456789ab")
    assert refused.returncode == 2 and "recipe.recipe_hash: cannot be overridden" in refused.stderr


def test_relative_data_paths_are_anchored_so_the_resolved_recipe_reruns_from_another_folder(tmp_path):
    (tmp_path / "recipes" / "corpus").mkdir(parents=True)
    (tmp_path / "recipes" / "corpus" / "a.txt").write_text("hello world\n" * 50)
    source = tmp_path / "recipes" / "text.json"
    source.write_text(json.dumps({
        "model": {"size": "tiny"}, "batch": {"micro_batch_per_rank": 2}, "training": {"max_steps": 5},
        "data": {"kind": "text", "paths": ["corpus/*.txt"], "cache_dir": "${recipe_dir}/cache", "seq_len": 16}}))
    recipe = load_recipe(source)
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / "recipe.json"
    copy.write_text(recipe.to_json())
    again = load_recipe(copy)
    assert (again.hash, again.data.paths, again.data.cache_dir) == (recipe.hash, recipe.data.paths,
                                                                  tmp_path / "recipes" / "cache")


def test_epochs_override_on_a_recipe_with_max_steps_runs_and_shows_the_epoch(tmp_path):
    proc = run_cli("run", "quickstart", "training.epochs=1", "data.num_samples=64", "training.log_interval=2",
                   "scheduler.type=constant", "training.eval_batches=0", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert [line.split(" | ")[1] for line in _progress(proc.stdout)] == ["epoch 0.50/1.00", "epoch 1.00/1.00"]  # 4 steps
    steps = run_cli("run", "quickstart", "training.max_steps=2", "training.log_interval=1", "scheduler.type=constant",
                    "training.eval_batches=0",
                    "--run-dir", str(tmp_path / "steps"))
    assert [line.split(" | ")[1][:4] for line in _progress(steps.stdout)] == ["loss", "loss"]  # no epoch column


def _progress(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("step ") and "| lr " in line]


def test_null_removes_a_key_and_max_steps_back_after_epochs(tmp_path):
    both = run_cli("validate", "quickstart", "training.max_steps=null", "training.epochs=0.5")
    assert both.returncode == 0 and "128 steps" in both.stdout, both.stderr  # 4096 / 16 / 2
    back = run_cli("validate", "quickstart", "training.epochs=2", "training.max_steps=7")
    assert back.returncode == 0 and "7 steps" in back.stdout, back.stderr
    neither = run_cli("validate", "quickstart", "training.max_steps=null")
    assert neither.returncode == 2 and neither.stderr == "error: recipe.training: give exactly one of max_steps or epochs\n"


def test_pretrained_override_on_a_recipe_with_a_size_clears_the_size(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256}))
    proc = run_cli("validate", "quickstart", f"model.pretrained={tmp_path / 'model'}")
    assert proc.returncode == 0, proc.stderr
    explicit = run_cli("validate", "quickstart", f"model.pretrained={tmp_path / 'model'}", "model.n_layer=4")
    assert explicit.returncode == 0, explicit.stderr  # setting a dimension clears pretrained again


def test_exclusive_keys_come_from_the_schema():
    from toolkit.recipe.schema import exclusive_keys, load_schema

    sections = load_schema()["properties"]
    assert exclusive_keys(sections["training"]) == {"max_steps": ["epochs"], "epochs": ["max_steps"]}
    model = exclusive_keys(sections["model"])
    assert model["pretrained"] == ["size", "n_layer", "n_embd", "n_head", "n_kv_head", "intermediate_size"]
    assert model["size"] == ["pretrained"]
