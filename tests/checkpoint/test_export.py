"""toolkit/checkpoint/export.py and `toolkit export`: a run's checkpoint -> a Hugging Face
folder that transformers loads on its own and that computes the trained logits;
for runs on text with the run's tokenizer, which AutoTokenizer loads and which
encodes as the run did."""
import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig

from tests.read_only_mount import make_read_only
from toolkit.checkpoint.files import latest_checkpoint
from toolkit.checkpoint.io import load_checkpoint
from toolkit.cli.main import main
from toolkit.runtime.engine import Engine
from toolkit.errors import UserError
from toolkit.checkpoint.export import export_hf
from toolkit.checkpoint.generate import generate_text, load_generator
from toolkit.models.build import build_config
from toolkit.recipe.load import load_recipe, recipe_from_dict
from toolkit.data.tokenizer import load_tokenizer_folder, run_tokenizer_dir
from toolkit.train.loop import run

TINY = ["data.num_samples=64", "data.seq_len=32", "data.eval_samples=16", "batch.micro_batch_per_rank=8",
        "scheduler.warmup_num_steps=1", "training.max_steps=3", "training.eval_batches=0", "logging.console=false",
        "checkpoint.interval=2"]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def trained(request, tmp_path_factory):
    """A 3-step run (checkpoints at steps 2 and 3) and its recipe."""
    recipe = load_recipe("quickstart", [*TINY, f"model.family={request.param}"])
    run_dir = tmp_path_factory.mktemp(f"run-{request.param}")
    run(recipe, run_dir, quiet=True)
    return recipe, run_dir


def trained_logits(recipe, step_dir, tokens):
    """Logits of the toolkit's own model with the checkpoint's weights."""
    engine = Engine(recipe)
    engine.load_state_dict(load_checkpoint(step_dir).state["engine"])
    engine.model.eval()
    with torch.no_grad():
        return engine.model(input_ids=tokens).logits


def test_export_round_trip_gives_the_trained_logits(trained, tmp_path):
    recipe, run_dir = trained
    out = tmp_path / "hf"
    done = export_hf(run_dir, out)
    assert done.step == 3 and done.files == ["config.json", "generation_config.json", "model.safetensors",
                                             "tokenizer.json", "tokenizer_config.json"]  # synthetic: ids as words
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = torch.randint(0, recipe.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = hf(input_ids=tokens).logits
    expected = trained_logits(recipe, latest_checkpoint(run_dir / "checkpoints"), tokens)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # and the weights are the trained ones, not a fresh initialisation
    fresh = Engine(recipe).model.eval()
    with torch.no_grad():
        assert not torch.allclose(fresh(input_ids=tokens).logits, expected, atol=1e-3)
    GenerationConfig.from_pretrained(out)  # transformers reads it


def test_exported_config_is_the_recipes_config(trained, tmp_path):
    recipe, run_dir = trained
    export_hf(run_dir, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    expected = build_config(recipe.model).to_dict()
    for key in ("model_type", "vocab_size", "tie_word_embeddings", "n_layer", "n_embd", "n_head", "n_positions",
                "num_hidden_layers", "hidden_size", "num_key_value_heads", "intermediate_size"):
        assert written.get(key) == expected.get(key), key
    assert written["use_cache"] is True  # training turned it off; generation wants it


def test_tied_gpt2_head_is_written_once_and_tied_on_load(tmp_path):
    recipe = load_recipe("quickstart", [*TINY, "checkpoint.interval=0"])
    run(recipe, tmp_path / "run", quiet=True)
    export_hf(tmp_path / "run", tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()


def test_export_of_a_given_step_dir_through_the_cli(trained, tmp_path, capsys):
    recipe, run_dir = trained
    step2 = run_dir / "checkpoints" / "step-000002"
    capsys.readouterr()
    assert main(["export", str(step2), str(tmp_path / "hf")]) == 0
    assert "(step 2," in capsys.readouterr().out
    tokens = torch.arange(32).unsqueeze(0) % recipe.model.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        got = hf(input_ids=tokens).logits
    torch.testing.assert_close(got, trained_logits(recipe, step2, tokens), atol=1e-5, rtol=0)


def test_exported_files_are_readable_by_everyone_under_umask_022(trained, tmp_path, capsys):
    _, run_dir = trained
    old = os.umask(0o022)
    try:
        assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes  # safetensors wrote it 0600


def test_export_refuses_a_non_empty_out_dir_in_one_line(trained, tmp_path, capsys):
    _, run_dir = trained
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'hf'}: exists and is not empty; export into a new or empty folder\n"
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_export_into_a_read_only_folder_is_a_one_line_error(trained, tmp_path, capsys, monkeypatch, code):
    _, run_dir = trained
    (tmp_path / "mount").mkdir()
    make_read_only(monkeypatch, tmp_path / "mount", code)
    capsys.readouterr()
    assert main(["export", str(run_dir), str(tmp_path / "mount" / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'mount' / 'hf'}: cannot write: "), err
    assert errno.errorcode[code] in err and err.count("\n") == 1, err
    assert list((tmp_path / "mount").iterdir()) == []


def test_export_that_fills_the_disk_is_a_one_line_error_and_leaves_nothing(trained, tmp_path, capsys, monkeypatch):
    _, run_dir = trained

    def disk_full(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model.safetensors"))

    monkeypatch.setattr("toolkit.checkpoint.export._give_umask_permissions", disk_full)  # after every file is written
    capsys.readouterr()
    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {tmp_path / 'hf'}: cannot write: No space left on device (ENOSPC); "
                   "free space, or export into a folder you can write\n")
    assert list(tmp_path.iterdir()) == []  # no temporary folder, no half-written export


def test_export_of_a_run_dir_without_checkpoints_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'run'}: no complete checkpoint") and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UserError, match="no such file or directory"):
        export_hf(tmp_path / "missing", tmp_path / "hf")


# ---------------------------------------------------------------------------
# Runs on text: the export holds the run's tokenizer.

DOCS = [f"def add_{i}(a, b):\n    \"\"\"Sümme №{i} ✓\"\"\"\n    return a + b + {i}  # {'é' * (i % 3)}\n" for i in range(40)]
TEXTS = ["def f(x):\n    return 'ünïcödé' ☕ 🐍 日本語", "<|endoftext|> stays text", "\x00\r\n\t  spaces   ", ""]


def pretrained_folder(folder: Path) -> Path:
    """A local Hugging Face tokenizer folder whose end-of-text token is named </s>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return folder


@pytest.fixture(scope="module", params=["byte", "bpe", "pretrained"])
def text_run(request, tmp_path_factory):
    """A 3-step GPT-2 run on a tiny Python-like corpus with the given tokenizer: (tokenizer kind, run dir)."""
    root = tmp_path_factory.mktemp(f"text-{request.param}")
    (root / "corpus").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "corpus" / f"{i:02d}.py").write_text(doc, encoding="utf-8")
    data = {"kind": "text", "paths": [str(root / "corpus" / "*.py")], "seq_len": 32, "cache_dir": str(root / "cache"),
            "validation_fraction": 0, "tokenizer": request.param}
    if request.param == "bpe":
        data["vocab_size"] = 300
    if request.param == "pretrained":
        data["tokenizer_path"] = str(pretrained_folder(root / "hf-tok"))
    recipe = recipe_from_dict({"model": {"family": "gpt2", "size": "tiny"}, "data": data,
                               "batch": {"micro_batch_per_rank": 4}, "scheduler": {"warmup_num_steps": 1},
                               "training": {"max_steps": 3, "eval_interval": 0, "eval_batches": 0},
                               "logging": {"console": False}})
    run(recipe, root / "run", quiet=True)
    return request.param, root / "run"


def test_export_of_a_text_run_holds_its_tokenizer_which_auto_tokenizer_encodes_like_the_run(text_run, tmp_path):
    from transformers import AutoTokenizer

    kind, run_dir = text_run
    done = export_hf(run_dir, tmp_path / "hf")
    assert done.files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json"]
    run_tok = load_tokenizer_folder(run_dir / "tokenizer")
    assert run_tok.kind == kind
    hf = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    for text in TEXTS + DOCS[:3]:
        ids = run_tok.encode(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids) == run_tok.decode(ids)
    assert hf.eos_token_id == run_tok.eot_id and hf.eos_token == {"pretrained": "</s>"}.get(kind, "<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert len(hf) <= model.config.vocab_size and hf.model_max_length == model.config.n_positions == 32


def test_generate_on_an_export_uses_the_tokenizer_inside_it(text_run, tmp_path, capsys):
    kind, run_dir = text_run
    export_hf(run_dir, tmp_path / "hf")
    expected = generate_text(load_generator(run_dir), "def ", 12, temperature=0)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == expected + "\n" and f"tokenizer {kind}," in out.err


def test_export_without_the_runs_tokenizer_folder_rebuilds_byte_level_or_warns(text_run, tmp_path, capsys):
    kind, run_dir = text_run
    shutil.copytree(run_dir, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "tokenizer")
    capsys.readouterr()
    done = export_hf(tmp_path / "run", tmp_path / "hf")
    err = capsys.readouterr().err
    if kind == "byte":  # nothing was trained: the same tokenizer again
        assert err == "" and "tokenizer.json" in done.files
        assert load_tokenizer_folder(tmp_path / "hf").encode(TEXTS[0]) == list(TEXTS[0].encode("utf-8"))
    else:
        assert err.startswith(f"warning: {done.checkpoint}: the run's {kind} tokenizer is not at "
                              f"{tmp_path / 'run' / 'tokenizer'}; the export has no tokenizer") and err.count("\n") == 1
        assert "tokenizer.json" not in done.files


def test_run_tokenizer_dir_follows_a_nested_checkpoint_dir():
    assert run_tokenizer_dir(Path("/r/checkpoints/step-000003")) == Path("/r/tokenizer")
    assert run_tokenizer_dir(Path("/r/ck/nested/step-000003"), "ck/nested") == Path("/r/tokenizer")
