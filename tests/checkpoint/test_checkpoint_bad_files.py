"""Checkpoints a person (or another tool) has edited, and resumes under a changed
recipe: every JSON file a checkpoint holds is checked key by key, so a hand-edited
manifest.json or state.json (re-signed, so the checksums pass) or a garbage ZeRO shard
is one line naming the file and key for resume, export and generate; a recipe change
that would make a resumed run silently wrong is refused or warned about.
(Truncated, bit-flipped and unsigned edits: tests/checkpoint/test_checkpoint.py.)
"""
import hashlib
import json
import os
import shutil

import pytest

from tests.conftest import run_cli
from tests.checkpoint.checkpoint_helpers import TINY, tiny, train_losses
from tests.text_corpus import python_like_docs, text_recipe, write_corpus
from toolkit.cli.main import main
from toolkit.train.loop import run


def resign(step_dir):
    """Recompute manifest.json's sizes and checksums, as someone who edits a checkpoint on purpose would."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (step_dir / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def edit(step_dir, name, change):
    """Apply `change` to a JSON file of the checkpoint, then re-sign the manifest (unless it is the manifest)."""
    data = json.loads((step_dir / name).read_text())
    change(data)
    (step_dir / name).write_text(json.dumps(data))
    if name != "manifest.json":
        resign(step_dir)


def put(keys, value):
    def change(data):
        for key in keys[:-1]:
            data = data[key]
        if value is KeyError:
            del data[keys[-1]]
        else:
            data[keys[-1]] = value
    return change


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("saved")
    run(tiny("training.max_steps=2"), run_dir, quiet=True)
    return run_dir


def error_lines(capsys, argv) -> list[str]:
    """The error lines of a refused command (exit 2); stderr holds nothing else but warnings."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err.splitlines()
    assert code == 2, err
    assert all(line.startswith(("warning: ", "error: ")) for line in err), err
    return [line for line in err if line.startswith("error: ")]


EDITS = {
    "manifest without a sha256": ("manifest.json", put(["files", "state.json", "sha256"], KeyError),
                                  "manifest.json: files.state.json.sha256: missing"),
    "manifest files as a list": ("manifest.json", put(["files"], [1]), "manifest.json: files: is a list, expected"),
    "manifest naming a file outside": ("manifest.json", put(["files", "../../recipe.json"],
                                                            {"sha256": "0" * 64, "bytes": 3}),
                                       "manifest.json: files: '../../recipe.json' is not a file of the checkpoint"),
    "state step as text": ("state.json", put(["step"], "abc"), "state.json: step: is a string, expected an integer"),
    "state step not the manifest's": ("state.json", put(["step"], 7), "state.json: step: 7, but manifest.json says 2"),
    "stream epoch as text": ("state.json", put(["state", "stream", "epoch"], "x"), "state.stream.epoch: is a string"),
    "python rng state": ("state.json", put(["state", "rng", "python"], [1, 2]), "state.rng.python: not a generator"),
    "malformed tuple": ("state.json", put(["state", "engine", "scheduler"], {"__tuple__": 5}),
                        "state.engine.scheduler: __tuple__ holds int, expected a list"),
    "model shape as a list": ("state.json", put(["model_shape"], [1]), "model_shape: is a list, expected an object"),
    "optimizer state garbage": ("state.json", put(["state", "engine", "optimizer"], {"state": 1, "param_groups": 2}),
                                "state.engine.optimizer.state: is an integer"),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_a_hand_edited_checkpoint_is_one_line_for_resume_export_and_generate(tmp_path, capsys, saved_run, name):
    file, change, words = EDITS[name]
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    step_dir = run_dir / "checkpoints" / "step-000002"
    edit(step_dir, file, change)
    before = sorted(p.name for p in step_dir.iterdir())
    for argv in (["run", "quickstart", "--run-dir", str(run_dir), *TINY, "training.max_steps=4"],
                 ["export", str(run_dir), str(tmp_path / "out")],
                 ["generate", str(run_dir), "--max-new-tokens", "2"]):
        err = error_lines(capsys, argv)
        assert len(err) == 1 and err[0].startswith(f"error: {step_dir}/") and words in err[0], (argv[0], err)
    assert sorted(p.name for p in step_dir.iterdir()) == before and not (tmp_path / "out").exists()


def test_a_state_json_nested_too_deeply_is_one_line_through_the_real_cli(tmp_path, saved_run):
    shutil.copytree(saved_run, tmp_path / "run")
    step_dir = tmp_path / "run" / "checkpoints" / "step-000002"
    (step_dir / "state.json").write_text('{"format": "toolkit-checkpoint", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    resign(step_dir)
    proc = run_cli("run", "quickstart", "--run-dir", str(tmp_path / "run"), *TINY, "training.max_steps=4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: {step_dir / 'state.json'}: corrupt checkpoint file (the checkpoint's state): nested too deeply")


def test_a_garbage_zero_shard_is_one_line_naming_it(tmp_path, capsys):
    run(tiny("training.max_steps=2", "zero.stage=1"), tmp_path / "run", quiet=True)
    step_dir = tmp_path / "run" / "checkpoints" / "step-000002"
    shard = step_dir / "zero-rank-00000-of-00001.safetensors"
    shard.write_bytes(os.urandom(4096))
    resign(step_dir)
    for argv in (["run", "quickstart", "--run-dir", str(tmp_path / "run"), *TINY, "zero.stage=1", "training.max_steps=4"],
                 ["export", str(tmp_path / "run"), str(tmp_path / "out")]):
        err = error_lines(capsys, argv)
        assert len(err) == 1 and err[0].startswith(f"error: {shard}: not a readable ZeRO shard file"), err


def test_a_model_config_that_builds_no_model_is_one_line_on_export(tmp_path, capsys, saved_run):
    shutil.copytree(saved_run, tmp_path / "run")
    step_dir = tmp_path / "run" / "checkpoints" / "step-000002"
    for fields, words in (({"n_head": 0}, "ZeroDivisionError"), ({"n_head": 4, "vocab_size": -5}, "negative dimension")):
        edit(step_dir, "state.json", lambda data: data["model_config"].update(fields))
        err = error_lines(capsys, ["export", str(tmp_path / "run"), str(tmp_path / "out")])
        assert len(err) == 1 and "state.json: model_config does not build a gpt2 model: " in err[0], err
        assert words in err[0]


def test_a_data_position_outside_the_data_is_refused(tmp_path, capsys, saved_run):
    shutil.copytree(saved_run, tmp_path / "run")
    edit(tmp_path / "run" / "checkpoints" / "step-000002", "state.json", put(["state", "stream", "step_in_epoch"], 10**6))
    err = error_lines(capsys, ["run", "quickstart", "--run-dir", str(tmp_path / "run"), *TINY, "training.max_steps=4"])
    assert err == ["error: resume: the checkpoint's data position (epoch 0, step 1000000 of the epoch) is outside "
                   "this data (16 steps per epoch); a hand-edited checkpoint?"]


# ---------------------------------------------------------------------------
# Resuming under a changed recipe: refused where the run would silently train on something else.

@pytest.mark.parametrize("override, words", [
    ("training.seed=7", "resume: data order changed: recipe.training.seed 1234 -> 7"),
    ("data.branching=8", "resume: data order changed: recipe.data.branching 4 -> 8"),
    ("data.seq_len=16", "resume: model shape changed: recipe.model.max_positions 32 -> 16"),
    ("batch.grad_accum_steps=2", "recipe.batch.global_batch 8 -> 16"),
])
def test_resume_refuses_changes_that_move_the_data_or_the_shapes(tmp_path, capsys, saved_run, override, words):
    shutil.copytree(saved_run, tmp_path / "run")
    err = error_lines(capsys, ["run", "quickstart", "--run-dir", str(tmp_path / "run"), *TINY, "training.max_steps=4",
                               override])
    assert any(words in line for line in err), err


def test_resume_allows_a_zero_stage_change_with_a_warning(tmp_path, capsys, saved_run):
    shutil.copytree(saved_run, tmp_path / "run")
    capsys.readouterr()
    assert main(["run", "quickstart", "--run-dir", str(tmp_path / "run"), *TINY, "training.max_steps=3",
                 "zero.stage=2"]) == 0
    assert "recipe.zero.stage 0 -> 2" in capsys.readouterr().err
    assert [s for s, _ in train_losses(tmp_path / "run")] == [1, 2, 3]


def test_a_changed_checkpoint_dir_does_not_start_fresh_over_the_old_checkpoints(tmp_path, capsys, saved_run):
    shutil.copytree(saved_run, tmp_path / "run")
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    err = error_lines(capsys, ["run", "quickstart", "--run-dir", str(tmp_path / "run"), *TINY, "training.max_steps=4",
                               "checkpoint.dir=ckpts"])
    assert err == ["error: recipe.checkpoint.dir: 'ckpts' holds no checkpoint, but this run dir's last run saved to "
                   "'checkpoints' (step-000002); set checkpoint.dir back to resume from it, or "
                   "checkpoint.resume=never to start fresh"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_resume_warns_when_the_corpus_changed_and_allows_a_new_cache_dir(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", python_like_docs(40))
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps(text_recipe(tmp_path, {"validation_fraction": 0}, training={
        "max_steps": 2, "eval_interval": 0, "eval_batches": 0, "log_interval": 1})))
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run")]) == 0
    doc = corpus / "doc007.txt"
    doc.write_text(doc.read_text().replace("return", "yield!"))  # same length: the same number of sequences
    capsys.readouterr()
    assert main(["run", str(recipe), "--run-dir", str(tmp_path / "run"), "training.max_steps=3",
                 f"data.cache_dir={tmp_path / 'cache2'}"]) == 0
    err = capsys.readouterr().err
    assert "warning: resume: the corpus changed since the checkpoint" in err
    assert "recipe.data.cache_dir" in err and "error" not in err


@pytest.mark.parametrize("pointer", [None, "../../etc\n", "step-000009\n"])
def test_a_missing_or_wrong_latest_pointer_still_resumes_from_the_newest_step(tmp_path, capsys, saved_run, pointer):
    shutil.copytree(saved_run, tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    if pointer is None:
        latest.unlink()
    else:
        latest.write_text(pointer)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert main(["run", "quickstart", "--run-dir", str(tmp_path / "run"), *TINY, "training.max_steps=3"]) == 0
    assert [s for s, _ in train_losses(tmp_path / "run")] == [1, 2, 3]
