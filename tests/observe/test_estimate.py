"""Analytic memory estimator: the ZeRO paper's example, parameter counts against transformers,
the activation formula against Korthikanti et al., the device verdict and `toolkit estimate`."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.cli.main import main
from toolkit.errors import UserError
from toolkit.observe.estimate import (GB, GiB, estimate_activation_bytes, estimate_memory, estimate_model_state_bytes,
                                      find_device, fits, format_estimate, parameter_count)
from toolkit.observe.estimate_input import EstimateInput
from toolkit.specs import ModelSpec

ROOT = Path(__file__).resolve().parents[2]


def model_spec(family="gpt2", **shape) -> ModelSpec:
    fields = dict(family=family, size="tiny", n_layer=2, n_embd=64, n_head=4, n_kv_head=4, intermediate_size=256,
                  max_positions=64, vocab_size=256, pretrained=None, dropout=0.0, activation_checkpointing=False)
    return ModelSpec(**{**fields, **shape})


def test_zero_paper_example_7_5b_params_64_ranks_in_gb():
    # Rajbhandari et al. 2019, figure 1: 7.5B parameters, Adam (K = 12), N_d = 64 ranks.
    totals = [estimate_model_state_bytes(7_500_000_000, stage=s, world_size=64, dtype="fp16", layout="paper").gpu
              for s in range(4)]
    assert totals == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    assert [round(t / GB, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]  # the paper's GB is 1e9 bytes
    assert round(totals[0] / GiB, 1) == 111.8  # in GiB the same bytes read differently


def test_stage_breakdown_params_grads_optim():
    p, n = 1_000_000, 8
    assert estimate_model_state_bytes(p, stage=0, world_size=n, layout="paper").__dict__ == dict(
        params=2 * p, grads=2 * p, optim=12 * p, cpu_optim=0)
    assert estimate_model_state_bytes(p, stage=1, world_size=n, layout="paper").optim == 12 * p // n
    s2 = estimate_model_state_bytes(p, stage=2, world_size=n, layout="paper")
    assert (s2.params, s2.grads, s2.optim) == (2 * p, 2 * p // n, 12 * p // n)
    s3 = estimate_model_state_bytes(p, stage=3, world_size=n, dtype="bf16", layout="paper")
    assert (s3.params, s3.grads, s3.optim) == (2 * p // n, 2 * p // n, 12 * p // n)


def test_toolkit_layout_keeps_fp32_weights_at_stage0_and_fp32_gradient_shards():
    p, n = 1_000_000, 8
    s0 = estimate_model_state_bytes(p, stage=0, world_size=n, dtype="bf16")
    assert (s0.params, s0.grads, s0.optim) == (4 * p, 4 * p, 8 * p)  # autocast over fp32 weights
    assert s0.gpu == estimate_model_state_bytes(p, stage=0, world_size=n, dtype="bf16", layout="paper").gpu
    s1, s2, s3 = (estimate_model_state_bytes(p, stage=s, world_size=n, dtype="bf16") for s in (1, 2, 3))
    assert (s1.params, s1.grads, s1.optim) == (2 * p, 2 * p + 4 * p // n, 12 * p // n)
    assert (s2.params, s2.grads, s2.optim) == (2 * p, 4 * p // n, 12 * p // n)
    assert (s3.params, s3.grads, s3.optim) == (2 * p // n, 4 * p // n, 12 * p // n)
    fp32 = [estimate_model_state_bytes(p, stage=s, world_size=n, dtype="fp32") for s in range(4)]
    assert fp32 == [estimate_model_state_bytes(p, stage=s, world_size=n, dtype="fp32", layout="paper")
                    for s in range(4)]


def test_fp32_holds_4_byte_params_and_grads_and_8_byte_adam_states():
    s0 = estimate_model_state_bytes(1000, stage=0, world_size=4, dtype="fp32")
    assert (s0.params, s0.grads, s0.optim) == (4000, 4000, 8000)
    assert estimate_model_state_bytes(1000, stage=3, world_size=4, dtype="fp32").gpu == 16000 // 4


def test_partitions_round_up_like_padded_shards():
    assert estimate_model_state_bytes(10, stage=3, world_size=4).params == 2 * 3


def test_cpu_offload_moves_master_weights_and_adam_states_to_cpu():
    on_gpu = estimate_model_state_bytes(6400, stage=2, world_size=64)
    offloaded = estimate_model_state_bytes(6400, stage=2, world_size=64, offload="cpu")
    half = estimate_model_state_bytes(6400, stage=2, world_size=64, offload="cpu", offload_ratio=0.5)
    assert (half.optim, half.cpu_optim) == (12 * 50, 12 * 50)
    assert offloaded.optim == 0 and offloaded.cpu_optim == on_gpu.optim == 12 * 100
    assert offloaded.gpu == on_gpu.gpu - on_gpu.optim
    with pytest.raises(ValueError):
        estimate_model_state_bytes(6400, stage=0, world_size=1, offload="cpu")


def _transformers_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("shape", [dict(), dict(n_layer=3, n_embd=96, n_head=6, intermediate_size=384,
                                                max_positions=128, vocab_size=1000)])
def test_gpt2_parameter_count_matches_transformers(shape):
    from transformers import GPT2Config, GPT2LMHeadModel

    spec = model_spec("gpt2", **shape)
    config = GPT2Config(vocab_size=spec.vocab_size, n_positions=spec.max_positions, n_embd=spec.n_embd,
                        n_layer=spec.n_layer, n_head=spec.n_head, n_inner=spec.intermediate_size,
                        tie_word_embeddings=True)
    assert parameter_count(spec) == _transformers_count(GPT2LMHeadModel(config))


@pytest.mark.parametrize("kv_heads, tied", [(2, False), (4, False), (1, True)])
def test_llama_parameter_count_matches_transformers(kv_heads, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = model_spec("llama", n_kv_head=kv_heads, intermediate_size=176)
    config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.n_embd,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.n_layer,
                         num_attention_heads=spec.n_head, num_key_value_heads=kv_heads,
                         max_position_embeddings=spec.max_positions, tie_word_embeddings=tied)
    assert parameter_count(spec, tied_embeddings=tied) == _transformers_count(LlamaForCausalLM(config))


def test_pretrained_folder_shape_comes_from_its_config_json(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    spec = model_spec("gpt2", pretrained=tmp_path)  # the recipe's preset shape is not the folder's
    estimate = estimate_memory(spec, micro_batch=1, seq_len=8, dtype="fp32", world_size=1, stage=0)
    assert estimate.states.params == 4 * _transformers_count(LlamaForCausalLM(config))


def test_gpt2_block_activations_are_korthikanti_sbh_34_plus_5as_over_h():
    s, b, h, a, layers, vocab = 2048, 4, 1024, 16, 24, 50304
    spec = model_spec("gpt2", n_layer=layers, n_embd=h, n_head=a, n_kv_head=a, intermediate_size=4 * h,
                      vocab_size=vocab, max_positions=s)
    act = estimate_activation_bytes(spec, micro_batch=b, seq_len=s, dtype="bf16", attention="eager")
    per_layer = s * b * h * 34 + 5 * a * s * s * b  # = sbh(34 + 5as/h) bytes
    outside = 2 * 2 * s * b * h + s * b * h  # final-norm and head inputs, embedding dropout mask
    assert act.logits == s * b * vocab * (2 + 4 + 4)
    assert act.full == layers * per_layer + outside + act.logits
    assert act.checkpointed == layers * 2 * s * b * h + per_layer + outside + act.logits
    fp32 = estimate_activation_bytes(spec, micro_batch=b, seq_len=s, dtype="fp32", attention="eager")
    assert fp32.full > act.full


def test_sdpa_activations_drop_the_attention_scores_and_unused_dropout_masks():
    s, b, h, a, layers, vocab = 2048, 4, 1024, 16, 24, 50304
    spec = model_spec("gpt2", n_layer=layers, n_embd=h, n_head=a, n_kv_head=a, intermediate_size=4 * h,
                      vocab_size=vocab, max_positions=s)  # dropout 0
    act = estimate_activation_bytes(spec, micro_batch=b, seq_len=s, dtype="bf16")
    per_layer = s * b * h * 32 + 4 * a * s * b  # 34 sbh less the 2 sbh of dropout masks, plus the log-sum-exp
    assert act.full == layers * per_layer + 2 * 2 * s * b * h + act.logits
    with_dropout = estimate_activation_bytes(dataclasses.replace(spec, dropout=0.1), micro_batch=b, seq_len=s,
                                             dtype="bf16")
    assert with_dropout.full - act.full == layers * 2 * s * b * h + s * b * h


def test_activation_checkpointing_saves_most_activation_memory():
    spec = model_spec("llama", n_layer=22, n_embd=2048, n_head=32, n_kv_head=4, intermediate_size=5632,
                      vocab_size=32000, max_positions=2048)
    act = estimate_activation_bytes(spec, micro_batch=8, seq_len=2048, dtype="bf16")
    assert act.checkpointed - act.logits < (act.full - act.logits) / 5  # the logits are kept either way


def test_device_names_and_fit_verdict():
    assert find_device("h200") == "H200-141GB"
    assert find_device("A100-80GB") == find_device("a100_80gb") == "A100-80GB"
    assert fits(70 * GiB, "H100-80GB") and not fits(75 * GiB, "H100-80GB")  # 90% of 80 GiB is usable
    with pytest.raises(UserError, match="ambiguous"):
        find_device("a100")
    with pytest.raises(UserError, match="unknown device"):
        find_device("tpu-v5")


def test_format_estimate_table_marks_the_recipe_row_and_verdicts():
    spec = model_spec("gpt2", n_layer=48, n_embd=1600, n_head=25, n_kv_head=25, intermediate_size=6400,
                      vocab_size=50257, max_positions=1024)
    text = format_estimate(EstimateInput(spec, micro_batch=16, seq_len=1024, dtype="bf16", world_size=8, stage=2),
                           device="a100-40gb")
    rows = [line for line in text.splitlines() if line[:8].strip()[:1] in "*0123" and "GiB" in line]
    assert len(rows) == 7  # stages 0-3, then 1-3 with cpu offload
    assert sum(row.startswith("*") for row in rows) == 1 and rows[2].startswith("*  2")
    assert all(row.endswith("with ckpt") for row in rows)
    assert "1.56B parameters" in text


def test_estimate_input_from_recipe_carries_the_keys_the_estimators_read():
    from toolkit.recipe.load import load_recipe

    recipe = load_recipe("quickstart", ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_ratio=0.5",
                                        "zero.offload_param=cpu", "kernels.cross_entropy=off", "precision.dtype=bf16",
                                        "batch.micro_batch_per_rank=8", "batch.grad_accum_steps=2"], world_size=4)
    inp = EstimateInput.from_recipe(recipe)
    assert (inp.micro_batch, inp.grad_accum_steps, inp.world_size, inp.seq_len, inp.dtype) == (8, 2, 4, 64, "bf16")
    assert (inp.stage, inp.offload_optimizer, inp.offload_param, inp.offload_ratio) == (3, "cpu", "cpu", 0.5)
    assert inp.fused == (True, True, False) and inp.vocab_size == 256
    assert inp.token_buffer_bytes == (4096 + 256) * 65 * 8  # int64 tokens, seq_len + 1 per sample
    assert inp.num_params == parameter_count(recipe.model)
    assert inp.model_states() == estimate_model_state_bytes(inp.num_params, stage=3, world_size=4, dtype="bf16",
                                                            offload="cpu", offload_ratio=0.5)


def test_estimate_input_reads_a_pretrained_shape_on_first_use_not_when_built(tmp_path):
    spec = model_spec("gpt2", pretrained=tmp_path)
    inp = EstimateInput(spec, micro_batch=1, seq_len=8, dtype="fp32", world_size=1)  # no config.json: no error yet
    with pytest.raises(UserError, match="config.json: cannot read"):
        inp.num_params


def test_cli_estimate_quickstart_prints_table(capsys):
    assert main(["estimate", "recipes/quickstart.json"]) == 0
    out = capsys.readouterr().out
    assert "stage" in out and "total.ckpt" in out and "gpt2-tiny" in out
    assert main(["estimate", "quickstart", "zero.stage=3", "--world-size", "4", "--device", "rtx4090"]) == 0
    out = capsys.readouterr().out
    assert "RTX4090-24GB" in out and "world size 4" in out


def test_cli_estimate_unknown_device_is_one_line_exit_2(capsys):
    assert main(["estimate", "quickstart", "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --device tpu: unknown device")


def test_cli_estimate_does_not_import_torch():
    code = ("import sys; from toolkit.cli.main import main; "
            "rc = main(['estimate', 'recipes/quickstart.json', '--device', 'h100']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_estimate_names_a_reshaped_model_and_states_the_run_memory_line_terms_with_headroom(capsys):
    assert main(["estimate", "gpt2-124m", "model.n_layer=6", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "recipe gpt2-124m: gpt2-124m reshaped (n_layer 6), zero.stage 1" in out
    assert "model gpt2-124m reshaped (n_layer 6):" in out  # the stage table's header line too
    assert "predicted peak per rank (CUDA max allocated" in out and "reserved by the allocator (expandable segments): about" in out
    assert "model states" in out and "activations" in out and "headroom on H200-141GB (141.0 GiB):" in out
    assert main(["estimate", "quickstart", "training.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "the process's peak RSS" in out and "headroom on this host" in out and "a lower bound" in out


@pytest.mark.parametrize("mode, words", [
    ("exact", "zero.offload_update exact: the CPU step runs after each backward"),
    ("overlapped", "zero.offload_update overlapped: exact results, each bucket's CPU step started during"),
    ("delayed", "zero.offload_update delayed: one step stale after 100 exact steps; two 4-byte gradient"),
])
def test_estimate_names_the_offload_update_mode_and_its_buffers(mode, words, capsys):
    assert main(["estimate", "quickstart", "training.device=cpu", "zero.stage=2", "zero.offload_optimizer=cpu",
                 f"zero.offload_update={mode}", "training.grad_clip=0"]) == 0
    assert words in capsys.readouterr().out
