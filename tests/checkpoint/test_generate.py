"""`toolkit generate`: sampling from a run's latest checkpoint and from an
exported Hugging Face folder with the run's tokenizer (synthetic runs: ids as
words); the KV-cached loop against full recomputation (also past the context
window, which slides by half); greedy and top-k sampling; one-line errors with
exit code 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from toolkit.cli.main import main as cli_main
from toolkit.checkpoint.generate import generate_ids, generate_text, load_generator, sample_next

DOCS = [f"def add_{i}(a, b):\n    return a + b + {i}\n\n\nclass Point{i}:\n    x = {i}\n" for i in range(40)]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory) -> Path:
    """A tiny byte-level run on Python-like text, trained a few steps, with its final checkpoint."""
    root = tmp_path_factory.mktemp("gen")
    (root / "corpus").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "corpus" / f"{i:02d}.py").write_text(doc)
    recipe = {
        "model": {"family": "gpt2", "size": "tiny"},
        "data": {"kind": "text", "paths": [str(root / "corpus" / "*.py")], "seq_len": 32,
                 "cache_dir": str(root / "cache"), "validation_fraction": 0.1},
        "batch": {"micro_batch_per_rank": 4},
        "optimizer": {"lr": 0.01},
        "training": {"max_steps": 12, "eval_interval": 0, "eval_batches": 1, "log_interval": 4},
    }
    (root / "r.json").write_text(json.dumps(recipe))
    assert cli_main(["run", str(root / "r.json"), "--run-dir", str(root / "run")]) == 0
    return root / "run"


def test_generate_prints_the_prompt_and_a_seeded_continuation(text_run, capsys):
    args = ["generate", str(text_run), "--prompt", "def ", "--max-new-tokens", "24", "--seed", "3"]
    assert cli_main(args) == 0
    first = capsys.readouterr()
    assert first.out.startswith("def ") and len(first.out) > len("def \n")
    assert "step-000012" in first.err and "tokenizer byte, 257 tokens" in first.err
    assert cli_main(args) == 0
    assert capsys.readouterr().out == first.out   # same seed, same text
    assert cli_main([*args[:-1], "4"]) == 0
    assert capsys.readouterr().out != first.out


def test_cached_sampling_matches_full_recomputation_past_the_context(text_run):
    gen = load_generator(text_run)
    assert gen.max_positions == 32
    prompt = gen.tokenizer.encode(DOCS[0][:28])
    cached = generate_ids(gen, prompt, max_new_tokens=40, temperature=0, stop_at_eot=False)
    assert cached == generate_ids(gen, prompt, max_new_tokens=40, temperature=0, stop_at_eot=False, use_cache=False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(5):  # up to the first slide: the whole window every step, no cache
            ids.append(int(gen.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert cached[:5] == ids[len(prompt):]


def test_generation_past_the_context_feeds_one_token_per_step_between_slides(text_run):
    gen = load_generator(text_run)
    fed = []
    hook = gen.model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"].shape[1]),
                                               with_kwargs=True)
    try:
        prompt = gen.tokenizer.encode(DOCS[1][:28])
        new = generate_ids(gen, prompt, max_new_tokens=100, temperature=0, stop_at_eot=False)
    finally:
        hook.remove()
    assert len(new) == 100 and len(fed) == 100
    prefills = [n for n in fed[1:] if n > 1]
    # the window (32) slides by half: after the first fill, a prefill of 16 every 16 tokens; before
    # the KV cache was used past the context, every one of the ~96 tokens after it re-read 32 positions
    assert fed[0] == 28 and prefills == [16] * 6 and fed.count(1) == 93


def test_synthetic_runs_generate_their_token_ids_and_refuse_words(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(["run", "quickstart", "--run-dir", str(run), "training.max_steps=2", "data.num_samples=64",
                     "training.eval_batches=0", "scheduler.warmup_num_steps=1"]) == 0
    capsys.readouterr()
    greedy = ["--prompt", "3 17", "--max-new-tokens", "8", "--temperature", "0"]
    assert cli_main(["generate", str(run), *greedy]) == 0
    out, err = capsys.readouterr()
    tokens = out.split()
    assert tokens[:2] == ["3", "17"] and len(tokens) == 10 and all(0 <= int(t) < 256 for t in tokens)
    assert "tokenizer synthetic, 256 tokens" in err
    assert cli_main(["generate", str(run), "--max-new-tokens", "5"]) == 0
    assert len(capsys.readouterr().out.split()) == 6  # a seeded start token, then 5 new ones
    assert cli_main(["export", str(run), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert cli_main(["generate", str(tmp_path / "hf"), *greedy]) == 0
    assert capsys.readouterr().out == out  # the export holds the same tokenizer
    assert cli_main(["generate", str(run), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the model's line, then the error
    assert len(err) == 2 and err[1] == ("error: --prompt: 'hello': a synthetic run's tokens are its ids 0-255 "
                                        "separated by spaces (e.g. --prompt \"3 17 42\")")


def test_greedy_and_top_k_sampling():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    rng = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0, 0, rng) == 1
    assert {sample_next(logits, 1.0, 1, rng) for _ in range(20)} == {1}
    assert {sample_next(logits, 1.0, 2, rng) for _ in range(200)} == {1, 2}
    assert len({sample_next(logits, 5.0, 0, rng) for _ in range(400)}) == 4


def test_generate_from_an_exported_folder_with_the_runs_tokenizer(text_run, tmp_path, capsys):
    from toolkit.checkpoint.export import export_hf

    export_hf(text_run, tmp_path / "hf")
    expected = generate_text(load_generator(text_run), "class ", 16, temperature=0)
    assert cli_main(["generate", str(tmp_path / "hf"), "--prompt", "class ", "--max-new-tokens", "16",
                     "--temperature", "0", "--tokenizer", str(text_run / "tokenizer")]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert cli_main(["generate", str(tmp_path / "hf"), "--prompt", "class ", "--max-new-tokens", "16",
                     "--temperature", "0"]) == 0   # the export holds the run's tokenizer
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "error: --temperature: -1.0 must be 0 (greedy) or more"),
    (["--max-new-tokens", "0"], "error: --max-new-tokens: 0 must be at least 1"),
    (["--top-k", "-2"], "error: --top-k: -2 must be 0 (off) or more"),
])
def test_bad_sampling_arguments_are_one_line(text_run, capsys, args, message):
    assert cli_main(["generate", str(text_run), *args]) == 2
    assert capsys.readouterr().err.strip() == message


def test_generate_without_a_checkpoint_or_tokenizer_is_one_line(text_run, tmp_path, capsys):
    assert cli_main(["generate", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such file or directory"
    from toolkit.checkpoint.export import export_hf

    export_hf(text_run, tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    assert cli_main(["generate", str(tmp_path / "hf"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tokenizer at" in err[0]
