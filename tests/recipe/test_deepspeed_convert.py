"""`toolkit convert` and `initialize(ds_config)`: a corpus of DeepSpeed configs from DeepSpeed's docs and the
wild (tests/recipe/deepspeed_configs/, each file citing its source) converts, validates, carries every
supported value exactly (checked against this file's own table of DeepSpeed key -> recipe key), and reports
every other key; the file is read as DeepSpeed reads it; --strict exits 2; a converted config trains."""
import json
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from toolkit.errors import UserError
from toolkit.recipe.deepspeed import (convert_deepspeed, is_deepspeed_config, parse_deepspeed_json,
                                      read_deepspeed_config)

CORPUS = sorted((Path(__file__).parent / "deepspeed_configs").glob("*.json"))

# DeepSpeed leaf -> recipe key, written out here independently of the converter's tables.
SAME = {"train_batch_size": "batch.global_batch", "train_micro_batch_size_per_gpu": "batch.micro_batch_per_rank",
        "gradient_accumulation_steps": "batch.grad_accum_steps", "gradient_clipping": "training.grad_clip",
        "steps_per_print": "training.log_interval", "zero_optimization.stage": "zero.stage",
        "zero_optimization.reduce_bucket_size": "zero.reduce_bucket_size",
        "zero_optimization.allgather_bucket_size": "zero.allgather_bucket_size",
        "zero_optimization.offload_optimizer.device": "zero.offload_optimizer",
        "zero_optimization.offload_optimizer.ratio": "zero.offload_ratio",
        "zero_optimization.offload_param.device": "zero.offload_param",
        "zero_optimization.offload_optimizer.nvme_path": "zero.nvme_path",
        "zero_optimization.overlap_comm": "zero.overlap_comm",
        "wandb.project": "logging.wandb.project", "tensorboard.enabled": "logging.tensorboard",
        **{f"fp16.{k}": f"precision.fp16.{k}" for k in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                                        "hysteresis", "consecutive_hysteresis", "min_loss_scale")},
        **{f"optimizer.params.{k}": f"optimizer.{k}" for k in ("lr", "betas", "eps", "weight_decay", "freeze_step")},
        "optimizer.params.muon_lr": "optimizer.muon_lr", "optimizer.params.momentum": "optimizer.muon_momentum"}
# Leaves whose value becomes another value: (recipe key, {DeepSpeed value: recipe value}).
CHANGED = {"fp16.enabled": ("precision.dtype", {True: "fp16"}), "bf16.enabled": ("precision.dtype", {True: "bf16"}),
           "wandb.enabled": ("logging.wandb.mode", {True: "online", False: "disabled"}),
           "zero_optimization": ("zero.stage", {True: 1, False: 0}),
           "optimizer.params.adam_w_mode": ("optimizer.type", {True: "adamw", False: "adam"}),
           "optimizer.type": ("optimizer.type", {"OneBitAdam": "onebit_adam", "Muon": "muon"})}


def _leaves(node, prefix=""):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def _at(resolved: dict, path: str):
    for key in path.split("."):
        resolved = resolved[key]
    return resolved


def _scheduler_key(path: str) -> str | None:
    return f"scheduler.{path.split('.')[-1]}" if path.startswith("scheduler.params.") else None


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_corpus_config_converts_validates_and_carries_every_supported_value(path):
    ds = read_deepspeed_config(path)
    done = convert_deepspeed(ds, model="gpt2/tiny", source=path.name)
    recipe, resolved = done.recipe, done.recipe.resolved
    notes = [line for line in done.report if line.startswith("note:")]
    for leaf, value in _leaves(ds):
        if value == "auto":  # left to the recipe and said so, or (a key never carried) reported
            assert any(line.startswith(f"note: {leaf}: \"auto\"") for line in notes) or any(
                line.startswith(f"{leaf}: not carried over: ") for line in done.dropped), leaf
        elif leaf in SAME:
            want = int(value) if isinstance(value, float) and leaf.endswith("bucket_size") else value
            got = getattr(recipe.batch, SAME[leaf].split(".")[1]) if leaf in BATCH_KEYS else _at(resolved, SAME[leaf])
            assert got == want, leaf
        elif leaf in CHANGED and value in CHANGED[leaf][1]:
            assert _at(resolved, CHANGED[leaf][0]) == CHANGED[leaf][1][value], leaf
        elif _scheduler_key(leaf) and _scheduler_key(leaf).split(".")[1] in resolved["scheduler"]:
            assert _at(resolved, _scheduler_key(leaf)) == value, leaf
        elif leaf in ("optimizer.type", "scheduler.type"):
            assert str(_at(resolved, leaf)).lower() in (str(value).lower(), "adamw"), leaf
        elif leaf.startswith("activation_checkpointing") and leaf != "activation_checkpointing":
            assert resolved["model"]["activation_checkpointing"] is True
            assert any(line.startswith(f"{leaf}: not carried over: ") for line in done.dropped), leaf
        else:  # not carried: reported (the key itself, or the block holding it)
            assert any(line.startswith(f"{p}: not carried over: ") for line in done.dropped
                       for p in _prefixes(leaf)), f"{leaf} neither carried nor reported"
    assert "gradient_clipping" in ds or resolved["training"]["grad_clip"] == 0  # DeepSpeed's default: no clipping


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _prefixes(leaf: str):
    parts = leaf.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def test_every_corpus_config_validates_as_an_extension_of_a_base_recipe(tmp_path):
    for path in CORPUS:
        out = tmp_path / f"{path.stem}.json"
        result = run_cli("convert", str(path), "--recipe", "quickstart", "--out", str(out)) if path == CORPUS[0] \
            else None
        if result is None:
            done = convert_deepspeed(read_deepspeed_config(path), base="quickstart", out=out)
            out.write_text(json.dumps(done.written))
        else:
            assert result.returncode == 0, result.stderr
            assert "not carried" in result.stderr or "0 not" in result.stderr
        written = json.loads(out.read_text())
        assert (tmp_path / written["extends"]).resolve() == (REPO / "recipes" / "quickstart.json").resolve()
        from toolkit.recipe.load import load_recipe

        load_recipe(out)  # the written file validates as it stands


def test_file_is_read_as_deepspeed_reads_it():
    text = '{\n  // line\n  "a": "x // not a comment # nor this", # hash\n  /* block\n */ "b": [1, 2,],\n}\n'
    assert parse_deepspeed_json(text) == {"a": "x // not a comment # nor this", "b": [1, 2]}
    with pytest.raises(UserError, match=r"duplicate keys in DeepSpeed config: \['a'\]"):
        parse_deepspeed_json('{"a": 1, "a": 2}')
    with pytest.raises(UserError, match="line 2 column"):
        parse_deepspeed_json('{\n  "a" 1}')


def test_strict_exits_2_naming_each_key_not_carried_over(tmp_path):
    result = run_cli("convert", str(CORPUS_BY_NAME["monitor"]), "--strict", "--out", str(tmp_path / "r.json"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert any("csv_monitor: not carried over" in line for line in errors)
    assert any("wandb.team: not carried over" in line for line in errors)
    assert not (tmp_path / "r.json").exists()


CORPUS_BY_NAME = {p.stem: p for p in CORPUS}


def test_dict_detection_tells_deepspeed_configs_from_recipes():
    assert is_deepspeed_config(read_deepspeed_config(CORPUS_BY_NAME["cifar10"]))
    assert not is_deepspeed_config(json.loads((REPO / "recipes" / "quickstart.json").read_text()))


def test_converted_one_cycle_adam_config_trains_through_the_cli(tmp_path):
    out = tmp_path / "one_cycle.json"
    assert run_cli("convert", str(CORPUS_BY_NAME["one_cycle"]), "--recipe", "quickstart", "--out", str(out)).returncode == 0
    result = run_cli("run", str(out), "training.max_steps=3", "training.eval_batches=0", "training.log_interval=1",
                     "logging.console=false",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [line["lr"] for line in lines if "lr" in line]
    # OneCycle climbing from 1e-4 to 1e-3 over 1000 steps: the lr each step used
    assert lrs == pytest.approx([1e-4, 1e-4 + 9e-7, 1e-4 + 2 * 9e-7])


def test_initialize_takes_a_deepspeed_dict_and_trains(capsys):
    import torch
    import toolkit

    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
    ds = read_deepspeed_config(CORPUS_BY_NAME["zero2"])
    ds["bf16"]["enabled"] = False
    engine = toolkit.initialize(ds, model=model)
    assert engine.recipe.zero.stage == 2 and engine.recipe.batch.grad_accum_steps == 2
    losses = []
    for _ in range(4):  # two optimizer steps
        loss = engine(torch.randint(0, 64, (4, 9)))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    assert engine.global_step == 2 and all(0 < loss < 10 for loss in losses)
    assert "zero_optimization.contiguous_gradients: not carried over" in capsys.readouterr().err
    with pytest.raises(UserError, match="names no model"):
        toolkit.initialize(ds)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_comm_is_carried_to_the_recipes_key(overlap):
    done = convert_deepspeed({"zero_optimization": {"stage": 2, "overlap_comm": overlap}})
    assert done.recipe.zero.overlap_comm is overlap and done.written["zero"]["overlap_comm"] is overlap
    assert f"carried: zero_optimization.overlap_comm -> zero.overlap_comm = {json.dumps(overlap)}" in done.report
    assert not [line for line in done.dropped if "overlap_comm" in line]


FP16_AUTO = {"fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 3},
             "train_micro_batch_size_per_gpu": 2}


def test_fp16_auto_resolved_to_fp32_writes_no_loss_scale_and_says_why():
    done = convert_deepspeed(FP16_AUTO)
    assert done.recipe.precision.dtype == "fp32" and "precision" not in done.written
    for key in ("loss_scale", "initial_scale_power", "hysteresis"):
        assert (f"fp16.{key}: not carried over: no effect here: fp16.enabled is \"auto\" and the recipe's "
                "precision.dtype is fp32, which scales no loss") in done.dropped
    assert not [line for line in done.report if line.startswith("carried: fp16.")]


def test_fp16_auto_over_an_fp16_base_recipe_carries_the_loss_scale(tmp_path):
    done = convert_deepspeed(FP16_AUTO, base="gpt2-medium-zero2", out=tmp_path / "r.json")
    assert done.recipe.precision.dtype == "fp16"
    assert done.written["precision"]["fp16"] == {"loss_scale": 0, "initial_scale_power": 12, "hysteresis": 3}
    assert done.recipe.resolved["precision"]["fp16"]["initial_scale_power"] == 12
    assert not [line for line in done.dropped if line.startswith("fp16.")]


def test_steps_per_print_above_the_runs_length_is_warned_with_the_fix(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2000}
    done = convert_deepspeed(ds)
    assert (done.recipe.training.log_interval, done.recipe.training.max_steps) == (2000, 1000)
    assert ("warning: training.log_interval 2000 (steps_per_print) is not below training.max_steps 1000: the run "
            "writes one step line, its last; set training.log_interval to 50 or less") in done.report
    assert not [line for line in convert_deepspeed({**ds, "steps_per_print": 100}).report if "warning" in line]
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    result = run_cli("convert", str(tmp_path / "ds.json"), "--out", str(tmp_path / "r.json"))
    assert result.returncode == 0 and "\nwarning: training.log_interval 2000 " in result.stderr, result.stderr


def test_report_says_not_carried_over_once_a_line(tmp_path):
    result = run_cli("convert", str(CORPUS_BY_NAME["monitor"]), "--out", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "csv_monitor: not carried over: replaced by <run_dir>/metrics.jsonl, always written (one JSON object per " \
           "line)" in lines
    assert [line for line in lines if line.count("not carried") > 1] == []


def test_a_converted_batch_run_at_another_world_size_names_the_keys_that_fix_it(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                                  "gradient_accumulation_steps": 4}))
    assert run_cli("convert", str(tmp_path / "ds.json"), "--out", str(tmp_path / "r.json")).returncode == 0
    result = run_cli("run", str(tmp_path / "r.json"), "--nproc", "2", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: recipe.batch: global_batch 16 != micro_batch_per_rank 4 x grad_accum_steps 4 x world size 2 = 32; "
        "set batch.grad_accum_steps to 2 or batch.micro_batch_per_rank to 2 to keep the global batch, or "
        "batch.global_batch to 32"]


def test_deepspeed_muon_maps_both_groups_lrs_decay_and_its_defaults():
    ds = {"train_batch_size": 16, "optimizer": {"type": "Muon", "params": {
        "lr": 0.002, "adam_lr": 0.0005, "momentum": 0.9, "weight_decay": 0.1, "ns_method": "standard"}}}
    done = convert_deepspeed(ds, model="gpt2/tiny")
    optimizer = done.recipe.resolved["optimizer"]
    # lr is Muon's when adam_lr names the Adam group's; weight_decay is both groups'
    assert (optimizer["type"], optimizer["lr"], optimizer["muon_lr"]) == ("muon", 0.0005, 0.002)
    assert (optimizer["weight_decay"], optimizer["muon_weight_decay"], optimizer["muon_momentum"]) == (0.1, 0.1, 0.9)
    # absent: MuonWithAuxAdam's Adam-group defaults, not the recipe's
    assert (optimizer["betas"], optimizer["eps"]) == ([0.9, 0.95], 1e-10)
    assert not [line for line in done.dropped if "ns_method" in line]  # 'standard' is the toolkit's iteration
    gram = convert_deepspeed({**ds, "optimizer": {"type": "Muon", "params": {"ns_method": "gram"}}}, model="gpt2/tiny")
    assert any(line.startswith("optimizer.params.ns_method: not carried over: unsupported") for line in gram.dropped)
    assert gram.recipe.resolved["optimizer"]["lr"] == 3e-4 and gram.recipe.resolved["optimizer"]["muon_lr"] == 0.02


def test_a_zero_infinity_config_with_bf16_states_maps_to_the_recipes_tiers_and_16_bit_layout(tmp_path):
    """DeepSpeed's ZeRO-Infinity keys (both offloads on NVMe, one nvme_path) and its bf16 master, gradients and
    optimizer states land on zero.offload_*, zero.nvme_path, optimizer.state_dtype and zero.grad_dtype; the swap
    tuning knobs are reported as having no effect here, each with why."""
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
          "data_types": {"grad_accum_dtype": "bf16"},
          "zero_optimization": {"stage": 3,
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4,
                                                      "pipeline_read": True, "pipeline_write": True},
                                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 1e8,
                                                  "max_in_cpu": 1e9}}}
    done = convert_deepspeed(ds, model="gpt2/tiny")
    zero = done.recipe.zero
    assert (zero.offload_optimizer, zero.offload_param, zero.nvme_path) == ("nvme", "nvme", str(tmp_path))
    assert done.recipe.optimizer.state_dtype == "bf16" and zero.grad_dtype == "bf16"
    for key in ("offload_optimizer.buffer_count", "offload_optimizer.pipeline_read", "offload_param.buffer_size",
                "offload_param.max_in_cpu"):
        assert any(line.startswith(f"zero_optimization.{key}: not carried over: no effect here: ")
                   for line in done.dropped), key


def test_a_bf16_gradient_accumulation_without_bf16_states_is_reported_not_written():
    done = convert_deepspeed({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"},
                              "zero_optimization": {"stage": 2}})
    assert done.recipe.zero.grad_dtype == "fp32"
    assert any(line.startswith("data_types.grad_accum_dtype: not carried over: unsupported") for line in done.dropped)


def test_parameter_offload_below_stage_3_is_reported_as_having_no_effect():
    done = convert_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert done.recipe.zero.offload_param == "none"
    assert ("zero_optimization.offload_param: not carried over: no effect here: parameter offload needs stage 3 "
            "(stage is 2)") in done.dropped
