"""MFU inputs: FLOPs per token (6N + attention, with N = matmul parameters), the peak
FLOP/s table and device-name matching, and the start-up table's device rows."""
import json
import re

import pytest
import torch

from toolkit.data.batches import Dataset
from toolkit.runtime.engine import Engine
from toolkit.observe.flops import (PEAK_TFLOPS, MfuBasis, device_key, flops_per_token, matmul_parameters, mfu,
                           mfu_basis, peak_flops)
from toolkit.recipe.load import load_recipe
from toolkit.train.startup_table import startup_table


def meta_model(cls, config):
    with torch.device("meta"):  # shapes only: no memory, no init time
        return cls(config)


def test_gpt2_124m_matmul_parameters_are_nanogpts_count_and_flops_per_token_follow():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = meta_model(GPT2LMHeadModel, GPT2Config())  # the real GPT-2 124M shape
    assert sum(p.numel() for p in model.parameters()) == 124_439_808
    # wpe (1024 x 768) is a lookup: out; the tied wte is also the output head: in.
    assert matmul_parameters(model) == 124_439_808 - 1024 * 768 == 123_653_376  # nanoGPT's "123.65M"
    # PaLM appendix B: 6N + 12 * L * d * T at T = 1024.
    assert flops_per_token(123_653_376, 12, 768, 1024) == 6 * 123_653_376 + 12 * 12 * 768 * 1024 == 855_166_464


def test_untied_llama_counts_the_head_but_not_the_token_table():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = meta_model(LlamaForCausalLM, config)
    total = sum(p.numel() for p in model.parameters())
    assert matmul_parameters(model) == total - 1000 * 64


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("Tesla V100-SXM2-32GB", "V100"),
    ("Tesla T4", "T4"),
    ("AMD Instinct MI300X", "MI300X"),
    ("NVIDIA A10G", None),  # another part with other peaks: unknown rather than wrong
    ("NVIDIA L40", None),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),  # a slice of the chip
    ("CPU", None),
])
def test_device_names_as_torch_reports_them_map_to_the_table(name, key):
    assert device_key(name) == key


def test_peaks_are_dense_datasheet_numbers():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12  # 1979 with sparsity, halved
    assert peak_flops("NVIDIA H200", "bf16") == 989.5e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert peak_flops("NVIDIA H200", "fp32") == 67e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops("CPU", "fp32") is None
    for key, peaks in PEAK_TFLOPS.items():  # tensor-core peaks never below plain FP32
        assert all(value >= peaks["fp32"] for value in peaks.values()), key


def test_mfu_is_achieved_model_flops_over_all_devices_peak():
    # 8 H200s at 1M tokens/s on GPT-2 124M (855.2 MFLOPs per token): 855.2e12 / 7916e12.
    assert mfu(1e6, 855_166_464, 989.5e12, 8) == pytest.approx(0.108030, abs=1e-6)
    basis = MfuBasis("NVIDIA H200", "bf16", 1, 855_166_464, 989.5e12, 8)
    assert basis.mfu(1e6) == pytest.approx(0.108030, abs=1e-6)
    assert MfuBasis("CPU", "bf16", 1, 855_166_464, None, 1).mfu(1e6) is None


def test_startup_table_prints_device_peak_and_flops_per_token():
    recipe = load_recipe("quickstart", ["data.num_samples=256", "training.max_steps=6", "scheduler.type=constant"])
    engine = Engine(recipe)
    dataset = Dataset(recipe.data)
    basis = mfu_basis(engine.model, recipe.data.seq_len, "fp32", engine.device, 1)
    assert basis.peak_flops is None and basis.device_name == "CPU"
    table = startup_table(recipe, engine, dataset, basis)
    assert "CPU (cpu); peak FLOP/s unknown for fp32 on this device: MFU not reported" in table
    assert f"{basis.flops_per_token / 1e6:.2f} MFLOPs per token" in table
    h200 = MfuBasis("NVIDIA H200", "bf16", basis.n_params, basis.flops_per_token, 989.5e12, 1)
    assert "NVIDIA H200 (cpu); peak 989.5 TFLOP/s bf16 dense per device" in startup_table(recipe, engine, dataset,
                                                                                        h200)
    assert "allocator" not in table  # a CPU run has no CUDA allocator to describe
    engine.device = torch.device("cuda", 0)  # the row as a GPU run prints it (the conftest's setting, the CLI's)
    assert ("NVIDIA H200 (cuda:0); peak 989.5 TFLOP/s bf16 dense per device (vendor datasheet) for MFU; "
            "CUDA allocator: expandable segments (expandable_segments:True)") in startup_table(recipe, engine, dataset,
                                                                                            h200)


def test_a_cpu_run_prints_no_peak_warning_and_a_stated_peak_gives_mfu(tmp_path, capsys):
    from toolkit.cli.main import main

    args = ["run", "quickstart", "training.max_steps=2", "scheduler.warmup_num_steps=1", "data.num_samples=64",
            "training.eval_batches=0", "checkpoint.save_final=false"]
    assert main([*args, "--run-dir", str(tmp_path / "plain")]) == 0
    out, err = capsys.readouterr()
    assert "peak FLOP/s" not in err  # it asked the user to edit toolkit/observe/flops.py on every CPU run
    assert "MFU not reported (training.peak_tflops sets one)" in out
    assert "mfu" not in json.loads((tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()[-1])
    assert main([*args, "--run-dir", str(tmp_path / "stated"), "training.peak_tflops=0.5"]) == 0
    out, err = capsys.readouterr()
    assert "peak 0.5 TFLOP/s fp32 dense per device (recipe.training.peak_tflops) for MFU" in out and err == ""
    flops = float(re.search(r"([\d.]+) MFLOPs per token", out).group(1)) * 1e6
    last = json.loads((tmp_path / "stated" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["mfu"] == pytest.approx(last["tokens_per_s"] * flops / 0.5e12, rel=1e-2)  # MFLOPs printed to 0.01


def test_an_unknown_gpu_is_warned_about_once_with_the_recipe_key_to_set():
    from toolkit.observe.flops import unknown_peak_warning

    basis = MfuBasis("NVIDIA A10G", "bf16", 1, 1000, None, 1)
    first = unknown_peak_warning(basis)
    assert first.startswith("warning: no peak FLOP/s for 'NVIDIA A10G' in bf16") and "training.peak_tflops" in first
    assert unknown_peak_warning(basis) is None  # once per process
    assert unknown_peak_warning(MfuBasis("CPU", "fp32", 1, 1000, None, 1)) is None
    assert unknown_peak_warning(MfuBasis("NVIDIA H200", "bf16", 1, 1000, 989.5e12, 1)) is None
