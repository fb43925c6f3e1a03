"""A local pretrained folder of another architecture (a tiny Qwen2, random weights, built here with
save_pretrained: nothing is downloaded) trains, and the run says what it is: the folder's
model_type and path in `validate`, the start-up table and recipe.json, not the gpt2-tiny defaults."""
import json

import pytest
import torch

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def qwen2_recipe(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    Qwen2ForCausalLM(config).save_pretrained(root / "tiny-qwen2")
    recipe = {"model": {"pretrained": "tiny-qwen2"},
              "data": {"kind": "synthetic", "seq_len": 32, "vocab_size": 256, "num_samples": 64, "eval_samples": 8},
              "batch": {"micro_batch_per_rank": 4}, "scheduler": {"type": "constant"},
              "training": {"max_steps": 2, "eval_interval": 0},
              "logging": {"tensorboard": False, "wandb": {"mode": "disabled"}}}
    (root / "qwen.json").write_text(json.dumps(recipe))
    return root


def test_validate_names_the_folders_model_type_and_path(qwen2_recipe):
    done = run_cli("validate", str(qwen2_recipe / "qwen.json"))
    assert done.returncode == 0, done.stderr
    assert f"qwen2 from {qwen2_recipe / 'tiny-qwen2'}," in done.stdout
    assert "gpt2" not in done.stdout


@pytest.mark.slow
def test_a_pretrained_qwen2_run_is_labelled_by_its_config_in_the_table_and_recipe_json(qwen2_recipe):
    run_dir = qwen2_recipe / "run"
    done = run_cli("run", str(qwen2_recipe / "qwen.json"), "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    model_row = next(line for line in done.stdout.splitlines() if line.startswith("model "))
    assert f"qwen2 from {qwen2_recipe / 'tiny-qwen2'}:" in model_row
    assert "3 layers, width 32, 4 heads" in model_row  # the folder's shape, not the tiny preset's
    assert "gpt2" not in done.stdout
    saved = json.loads((run_dir / "recipe.json").read_text())["model"]
    # NOTE: anchored to the folder, so the run's recipe.json reruns from anywhere.
    assert saved["pretrained"] == str(qwen2_recipe / "tiny-qwen2") and "family" not in saved and "size" not in saved
