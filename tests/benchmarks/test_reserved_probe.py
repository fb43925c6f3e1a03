"""benchmarks/reserved_probe.py on the CPU, with torch.cuda's memory counters stood in for: it drives the engine
micro-step by micro-step through its hooks and prints one line after each micro-step and each optimizer step."""
import torch

from benchmarks import reserved_probe


def test_the_probe_prints_a_line_per_micro_step_and_per_step(monkeypatch, capsys):
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"total_size": 2**30, "allocated_size": 0}] * 2)
    tiny = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "model.max_positions=16",
            "batch.micro_batch_per_rank=2", "batch.grad_accum_steps=2", "batch.global_batch=4", "zero.stage=1",
            "training.device=cpu"]
    assert reserved_probe.main(["quickstart", *tiny, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if "allocated" in line and "reserved" in line] == \
        ["engine", "micro-step", "micro-step", "optimizer", "micro-step", "micro-step", "optimizer"]
    assert "| 1,024.0 | 0.0 | 2 |" in out and "segments holding nothing: 2.00 GiB of 3.00 reserved" in out
