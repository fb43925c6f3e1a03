"""toolkit/checkpoint/checkpointer.py: the state format, atomic saves, verified loads, exact
resume through the real loop, and what a changed recipe may do on resume."""
import json
import random
import shutil
import time

import numpy as np
import pytest
import torch

from tests.conftest import run_cli
from toolkit.checkpoint import io
from toolkit.checkpoint.files import latest_checkpoint, list_checkpoints
from toolkit.checkpoint.io import load_checkpoint, save_checkpoint
from toolkit.checkpoint.state import capture_rng_state, flatten_state, restore_rng_state, unflatten_state
from toolkit.cli.main import main
from toolkit.runtime.engine import Engine
from toolkit.errors import UserError
from toolkit.train.loop import run
from tests.checkpoint.checkpoint_helpers import TINY, tiny, train_losses

# A tiny, fast quickstart. dropout > 0 so that the resumed runs need the restored RNG
# states; total_num_steps pinned so a 4-step run and an 8-step run share one lr schedule.
def final_weights(run_dir):
    return load_checkpoint(latest_checkpoint(run_dir / "checkpoints")).state["engine"]["model"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------------------
# Format

def test_flatten_round_trips_int_keys_tuples_arrays_and_shared_tensors():
    shared = torch.arange(6.0)
    state = {"model": {"wte.weight": shared, "lm_head.weight": shared, "view": torch.arange(12.0)[::2]},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"betas": (0.9, 0.95)}]},
             "rng": (3, (1, 2, 3), None), "np": np.arange(4, dtype=np.uint32), "flag": True, "nothing": None}
    skeleton, tensors = flatten_state(state)
    json.dumps(skeleton)  # the skeleton is plain JSON
    # shared storage is cloned (safetensors refuses it), so the two tensors no longer alias
    assert tensors["model.wte.weight"].untyped_storage().data_ptr() != \
        tensors["model.lm_head.weight"].untyped_storage().data_ptr()
    back = unflatten_state(json.loads(json.dumps(skeleton)), tensors)
    assert list(back["optimizer"]["state"]) == [0]  # int key, not "0"
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert back["rng"] == (3, (1, 2, 3), None)
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3]
    assert torch.equal(back["model"]["view"], torch.arange(0.0, 12.0, 2.0))
    assert back["flag"] is True and back["nothing"] is None


def test_flatten_refuses_objects_it_would_have_to_pickle():
    with pytest.raises(TypeError, match="optimizer.fn"):
        flatten_state({"optimizer": {"fn": object()}})


def test_rng_states_survive_a_checkpoint_and_replay_the_same_draws(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()}, {})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(load_checkpoint(tmp_path / "step-000001").state["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


# ---------------------------------------------------------------------------
# Exact resume through the real loop

def test_n_steps_then_resume_to_2n_gives_identical_losses_and_weights(tmp_path, capsys):
    straight = tmp_path / "straight"
    run(tiny("training.max_steps=8"), straight, quiet=True)
    resumed = tmp_path / "resumed"
    run(tiny("training.max_steps=4"), resumed, quiet=True)
    run(tiny("training.max_steps=8"), resumed, quiet=True)
    # NOTE: exact equality: same CPU, same ops in the same order, same RNG and data position.
    assert train_losses(resumed) == train_losses(straight)
    assert [s for s, _ in train_losses(resumed)] == list(range(1, 9))  # appended, each step once
    assert_same_weights(final_weights(resumed), final_weights(straight))
    assert "recipe.training.max_steps 4 -> 8" in capsys.readouterr().err


def test_crash_then_auto_resume_matches_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    straight = tmp_path / "straight"
    run(tiny("training.max_steps=8", "checkpoint.interval=2"), straight, quiet=True)

    crashed = tmp_path / "crashed"
    real_train_batch = Engine.train_batch

    def crash_at_step_5(self, micro_batches):
        if self.global_step == 5:
            raise RuntimeError("simulated crash")
        return real_train_batch(self, micro_batches)

    monkeypatch.setattr(Engine, "train_batch", crash_at_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tiny("training.max_steps=8", "checkpoint.interval=2"), crashed, quiet=True)
    monkeypatch.setattr(Engine, "train_batch", real_train_batch)
    assert [s for s, _ in train_losses(crashed)] == [1, 2, 3, 4, 5]  # step 5 logged after the step-4 save
    capsys.readouterr()

    run(tiny("training.max_steps=8", "checkpoint.interval=2"), crashed, quiet=True)
    assert train_losses(crashed) == train_losses(straight)  # step 5 dropped from metrics.jsonl, then redone
    assert_same_weights(final_weights(crashed), final_weights(straight))
    assert "warning: resume" not in capsys.readouterr().err  # same recipe: nothing to warn about


def test_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tiny("training.max_steps=2", "logging.wandb.mode=offline"), tmp_path, quiet=True)
    first_id = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints")).wandb_run_id
    assert first_id
    time.sleep(1.1)  # NOTE: wandb names a session's folder by the second it started: two in one second share one
    run(tiny("training.max_steps=4", "logging.wandb.mode=offline"), tmp_path, quiet=True)
    assert load_checkpoint(latest_checkpoint(tmp_path / "checkpoints")).wandb_run_id == first_id
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{first_id}"))) == 2  # both sessions, one run id


def test_resume_keeps_the_recipes_optimizer_settings(tmp_path):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    saved = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    engine = Engine(tiny("training.max_steps=4", "optimizer.weight_decay=0.3", "optimizer.implementation=torch"))
    engine.load_state_dict(saved.state["engine"])
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.3, 0.0]
    assert engine.global_step == 2
    assert all(torch.equal(engine.optimizer.state[p]["exp_avg"], saved.state["engine"]["optimizer"]["state"][i]
                           ["exp_avg"]) for i, p in enumerate(engine.optimizer.param_groups[0]["params"]))


# ---------------------------------------------------------------------------
# What a changed recipe may do

def test_resume_refused_when_the_model_shape_changes(tmp_path, capsys):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    recipe_json = (tmp_path / "recipe.json").read_text()
    capsys.readouterr()
    code = main(["run", "quickstart", "--run-dir", str(tmp_path), *TINY, "training.max_steps=4", "model.n_layer=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: resume: model shape changed: recipe.model.n_layer 2 -> 3")
    assert len(err.splitlines()) == 1
    assert (tmp_path / "recipe.json").read_text() == recipe_json  # a refused resume changes nothing


def test_resume_refused_when_the_data_order_changes(tmp_path):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    with pytest.raises(UserError, match=r"resume: data order changed: recipe.data.num_samples 128 -> 256"):
        run(tiny("training.max_steps=4", "data.num_samples=256"), tmp_path, quiet=True)
    with pytest.raises(UserError, match=r"recipe.batch.global_batch 8 -> 16"):
        run(tiny("training.max_steps=4", "batch.micro_batch_per_rank=16"), tmp_path, quiet=True)


def test_resume_allows_a_precision_change_with_a_warning(tmp_path, capsys):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    run(tiny("training.max_steps=3", "precision.dtype=bf16", "logging.tensorboard=true"), tmp_path, quiet=True)
    err = capsys.readouterr().err
    assert "recipe.precision.dtype fp32 -> bf16 (weights and AdamW state are fp32" in err
    assert "recipe.logging.tensorboard false -> true" in err
    assert [s for s, _ in train_losses(tmp_path)] == [1, 2, 3]


def test_resume_never_starts_fresh_and_drops_the_old_checkpoints(tmp_path, capsys):
    run(tiny("training.max_steps=4", "checkpoint.interval=2"), tmp_path, quiet=True)
    run(tiny("training.max_steps=2", "checkpoint.resume=never"), tmp_path, quiet=True)
    assert "come from an earlier run" in capsys.readouterr().err
    assert [s for s, _ in train_losses(tmp_path)] == [1, 2]
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2]


def test_resume_from_a_missing_path_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError) as info:
        run(tiny("training.max_steps=2", f"checkpoint.resume={tmp_path / 'nope'}"), tmp_path / "run", quiet=True)
    assert info.value.lines == [f"recipe.checkpoint.resume: {tmp_path / 'nope'}: no such file or directory"]


def test_resume_from_an_explicit_step_dir(tmp_path):
    run(tiny("training.max_steps=4", "checkpoint.interval=2"), tmp_path / "a", quiet=True)
    step2 = tmp_path / "a" / "checkpoints" / "step-000002"
    run(tiny("training.max_steps=4", f"checkpoint.resume={step2}"), tmp_path / "b", quiet=True)
    assert [s for s, _ in train_losses(tmp_path / "b")] == [3, 4]
    assert_same_weights(final_weights(tmp_path / "b"), final_weights(tmp_path / "a"))


# ---------------------------------------------------------------------------
# Cadence, pruning, atomicity, corruption

def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    run(tiny("training.max_steps=5", "checkpoint.interval=1", "checkpoint.keep_last=2"), tmp_path, quiet=True)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000004", "step-000005"]
    assert (ckpts / "latest").read_text().strip() == "step-000005"
    files = sorted(p.name for p in (ckpts / "step-000005").iterdir())
    assert files == ["manifest.json", "state.json", "state.safetensors"]


def test_interrupted_save_leaves_latest_and_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    ckpts = tmp_path / "checkpoints"

    def power_cut(*args):
        raise OSError("simulated power cut before the rename")

    monkeypatch.setattr(io.os, "rename", power_cut)
    with pytest.raises(OSError, match="power cut"):
        run(tiny("training.max_steps=4"), tmp_path, quiet=True)
    monkeypatch.undo()
    assert (ckpts / "latest").read_text().strip() == "step-000002"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000002"]
    load_checkpoint(ckpts / "step-000002")  # still complete and valid


def test_temp_dirs_left_by_a_killed_save_are_ignored_then_swept(tmp_path):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    ckpts = tmp_path / "checkpoints"
    # What `kill -9` during the save of step 9 leaves: a temp dir with a half-written file.
    leftover = ckpts / ".tmp-step-000009-x1y2"
    shutil.copytree(ckpts / "step-000002", leftover)
    with open(leftover / "state.safetensors", "r+b") as f:
        f.truncate(100)
    assert latest_checkpoint(ckpts) == ckpts / "step-000002"
    run(tiny("training.max_steps=3"), tmp_path, quiet=True)
    assert [s for s, _ in train_losses(tmp_path)] == [1, 2, 3]  # resumed from 2, not from the leftover
    assert not leftover.exists()  # swept once a new checkpoint completed


@pytest.mark.parametrize("damage, words", [("flip", "checksum mismatch"), ("truncate", "truncated")])
def test_damaged_checkpoint_is_a_one_line_error_naming_the_file(tmp_path, capsys, damage, words):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    target = tmp_path / "checkpoints" / "step-000002" / "state.safetensors"
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
    else:
        data = data[:len(data) // 2]
    target.write_bytes(bytes(data))
    capsys.readouterr()
    code = main(["run", "quickstart", "--run-dir", str(tmp_path), *TINY, "training.max_steps=4"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [err.strip()]
    assert str(target) in err and words in err


def test_corrupt_checkpoint_through_the_real_cli_exits_2_without_traceback(tmp_path):
    run(tiny("training.max_steps=2"), tmp_path, quiet=True)
    state_json = tmp_path / "checkpoints" / "step-000002" / "state.json"
    state_json.write_text(state_json.read_text().replace('"step": 2', '"step": 7'))
    proc = run_cli("run", "quickstart", "--run-dir", str(tmp_path), *TINY, "training.max_steps=4")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: {state_json}: checksum mismatch: the file is corrupt")
    assert lines[0].endswith("or start fresh with checkpoint.resume=never")


def test_missing_manifest_means_incomplete(tmp_path):
    save_checkpoint(tmp_path, 3, {"x": torch.ones(2)}, {})
    (tmp_path / "step-000003" / "manifest.json").unlink()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(UserError, match=r"manifest.json: missing"):
        load_checkpoint(tmp_path / "step-000003")
