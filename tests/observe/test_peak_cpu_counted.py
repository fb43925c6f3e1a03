"""The CPU's fp32 activation terms in toolkit/observe/peak.py are counted, not fitted: what autograd saves for
one block (a two-block model's saved bytes less a one-block model's) equals CPU_FP32_BLOCK_* for both families,
at shapes the count was not read from; what it saves outside the blocks is CPU_FP32_OUTSIDE_H and a few
per-token numbers; and the whole training step's peak (tutorial 10's measurement) is within
CALIBRATION_TOLERANCE of the prediction."""
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import toolkit
from tests.conftest import REPO
from toolkit.observe.notebook import live_state_bytes, rss_follows_tensors, saved_activation_bytes, step_peak_bytes
from toolkit.observe.peak import CALIBRATION_TOLERANCE, activation_peak_bytes, predict_peak

SHAPES = {  # (family, n_embd, n_head, n_kv_head, intermediate_size); other than the 96-wide model the count used
    "llama gqa": ("llama", 64, 4, 1, 160),
    "llama mha": ("llama", 128, 2, 2, 288),
    "gpt2": ("gpt2", 80, 4, 4, None),
}


def _overrides(family, width, heads, kv_heads, mlp, *, layers, micro=4, seq=32, extra=()):
    shape = [f"model.n_kv_head={kv_heads}", f"model.intermediate_size={mlp}"] if family == "llama" else []
    return [f"model.family={family}", f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}",
            *shape, f"data.seq_len={seq}", f"model.max_positions={seq}", f"batch.micro_batch_per_rank={micro}",
            "training.device=cpu", "precision.dtype=fp32", *extra]


def _saved(overrides):
    torch.manual_seed(0)
    recipe = toolkit.load_recipe("quickstart", overrides)
    engine = toolkit.initialize(recipe)
    batch = torch.randint(0, recipe.data.vocab_size, (recipe.batch.micro_batch_per_rank, recipe.data.seq_len + 1))
    return saved_activation_bytes(engine, batch), recipe


@pytest.mark.parametrize("name", SHAPES)
def test_one_blocks_saved_bytes_are_the_counted_terms(name):
    one, _ = _saved(_overrides(*SHAPES[name], layers=1))
    two, recipe = _saved(_overrides(*SHAPES[name], layers=2))
    m = recipe.model
    # the model's two-block activations less its one-block ones, as peak.py predicts them
    predict = {n: activation_peak_bytes(replace(m, n_layer=n), micro_batch=recipe.batch.micro_batch_per_rank,
                                        seq_len=recipe.data.seq_len, dtype="fp32", stage=0, on_cuda=False)[0]
               for n in (1, 2)}
    block_predicted = predict[2] - predict[1]
    assert two - one == block_predicted, (two - one, block_predicted)
    # outside the blocks: the final norm's tensors (CPU_FP32_OUTSIDE_H); the loss's fp32 log-probabilities are
    # the logits term's; what is left is at most the int64 token ids, targets and positions, the final norm's
    # statistics and the rotary tables (cos and sin, per position)
    seq = recipe.data.seq_len
    t = recipe.batch.micro_batch_per_rank * seq
    log_probs = 4 * t * recipe.data.vocab_size
    small = 3 * 8 * t + 2 * 4 * t + 2 * 4 * seq * (m.n_embd // m.n_head)
    assert 0 <= one - log_probs - predict[1] <= small, (one - log_probs - predict[1], small)


def measure_step(*extra) -> tuple[int, int]:
    """(predicted, measured) bytes of one CPU training step as tutorial 10 measures it: the live model states before
    the step plus the resident set the step adds, the allocator returning blocks."""
    rss_follows_tensors()
    recipe = toolkit.load_recipe("quickstart", _overrides("llama", 96, 4, 2, 256, layers=6, micro=16, seq=128,
                                                          extra=extra))
    engine = toolkit.initialize(recipe)
    batch = [torch.randint(0, recipe.data.vocab_size, (16, 129))]
    engine.train_batch(batch)
    measured = live_state_bytes(engine) + step_peak_bytes(engine, batch)
    p = predict_peak(recipe, on_cuda=False)
    return p.states + p.weight_cache + p.activations + p.logits, measured


@pytest.mark.parametrize("extra", [(), ("model.activation_checkpointing=true",)], ids=["plain", "checkpointed"])
def test_a_cpu_steps_measured_peak_is_within_tolerance_of_the_prediction(extra):
    # NOTE: in a process of its own: the resident set is the whole process's, and a test worker's earlier tests
    # (threads, arenas) moved it by 10 MiB in CI
    code = f"from tests.observe.test_peak_cpu_counted import measure_step; print(*measure_step(*{list(extra)!r}))"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    predicted, measured = map(int, done.stdout.split()[-2:])
    assert abs(predicted / measured - 1) <= CALIBRATION_TOLERANCE, (predicted / 2**20, measured / 2**20)


def test_a_checkpointed_block_keeps_an_fp32_input_at_stage_0_and_a_16_bit_one_above():
    """CKPT_FP32_INPUT_H is counted: under bf16 autocast with checkpointing, what one more block adds to the saved
    bytes is its input alone, fp32 at stage 0 (fp32 weights, so an fp32 residual stream) and bf16 at stage 1."""
    from toolkit.observe.peak import CKPT_FP32_INPUT_H

    def one_block(stage):
        extra = ("precision.dtype=bf16", "model.activation_checkpointing=true", f"zero.stage={stage}")
        saved = [_saved(_overrides("gpt2", 64, 4, 4, None, layers=n, extra=extra))[0] for n in (1, 2)]  # bf16 wins
        return saved[1] - saved[0]

    t, h = 4 * 32, 64
    assert one_block(1) == 2 * t * h
    assert one_block(0) - one_block(1) == CKPT_FP32_INPUT_H * t * h


def test_bf16_optimizer_states_at_stage_0_keep_a_16_bit_stream_as_stage_1_does():
    """optimizer.state_dtype bf16 makes the bf16 weights the master at stage 0: no fp32 weights under autocast, so
    no fp32 residual stream and no autocast weight copies. Measured: a checkpointed block saves its bf16 input alone
    (stage 1's bytes), and a block without checkpointing saves what stage 1's saves, bf16 weight copies included
    in neither; predicted the same way."""
    def one_block(stage, *extra):
        extra = ("precision.dtype=bf16", f"zero.stage={stage}", *extra)
        saved = [_saved(_overrides("gpt2", 64, 4, 4, None, layers=n, extra=extra))[0] for n in (1, 2)]
        return saved[1] - saved[0]

    t, h = 4 * 32, 64
    bf16_states = "optimizer.state_dtype=bf16"
    assert one_block(0, bf16_states, "model.activation_checkpointing=true") == 2 * t * h
    assert one_block(0, bf16_states) == one_block(1) < one_block(0)
    # micro 64: the activations outweigh the bf16 step's temporaries, so both peaks are backward's moment
    recipe = toolkit.load_recipe("quickstart", _overrides("gpt2", 64, 4, 4, None, layers=2, micro=64, extra=(
        "precision.dtype=bf16", bf16_states)))
    stage1 = toolkit.load_recipe("quickstart", _overrides("gpt2", 64, 4, 4, None, layers=2, micro=64, extra=(
        "precision.dtype=bf16", bf16_states, "zero.stage=1")))
    for on_cuda in (False, True):
        assert predict_peak(recipe, on_cuda=on_cuda).weight_cache == 0
        assert predict_peak(stage1, on_cuda=on_cuda).step_temporaries == 0
        assert predict_peak(recipe, on_cuda=on_cuda).activations == predict_peak(stage1, on_cuda=on_cuda).activations


@pytest.mark.parametrize("window", [None, 4096], ids=["whole", "windowed"])
@pytest.mark.parametrize("stage", [0, 1])
def test_the_bf16_steps_fp32_temporaries_are_counted(stage, window, monkeypatch):
    """optimizer.state_dtype bf16: what the optimizer step holds above what it started with (the live tensor
    storages) is bf16_step_temporary_bytes, at stage 0 (one parameter at a time) and stage 1 (a shard segment),
    whole and in windows (monkeypatched small). On an H100 the same count was 0.75 GiB at llama-1b's window."""
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.peak import bf16_step_temporary_bytes
    from toolkit.observe.step_memory_timeline import record_step_memory
    from toolkit.runtime import low_precision_adamw
    from toolkit.observe import peak

    if window:
        monkeypatch.setattr(low_precision_adamw, "STEP_WINDOW", window)
        monkeypatch.setattr(peak, "BF16_STEP_WINDOW", window)
    recipe = toolkit.load_recipe("quickstart", ["training.device=cpu", "precision.dtype=bf16",
                                                "optimizer.state_dtype=bf16", f"zero.stage={stage}"])
    engine = toolkit.initialize(recipe)
    batch = torch.randint(0, recipe.data.vocab_size, (recipe.batch.micro_batch_per_rank, recipe.data.seq_len + 1))
    engine.train_batch([batch] * recipe.batch.grad_accum_steps)  # the moments exist before the step measured
    measured = record_step_memory(engine, batch).rise("optimizer step")
    inp = EstimateInput.from_recipe(recipe)
    predicted = bf16_step_temporary_bytes(inp, inp.num_params)
    assert abs(predicted / measured - 1) <= 0.05, (predicted, measured)
