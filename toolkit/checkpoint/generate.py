"""`toolkit generate`: sample text from a trained run's latest checkpoint (or a
step dir, or an exported Hugging Face folder) with the run's tokenizer (for
synthetic data: the token ids as words, `--prompt "3 17 42"`).

Sampling is the plain autoregressive loop: temperature-scaled softmax over the
last position's logits, optionally restricted to the top k, with the KV cache:
one token's forward pass per new token. Past the model's context the window
slides by half a context at a time: the older half is dropped and the cache is
prefilled again from the newer half (llama.cpp's context shift), so a long
generation costs one prefill of max_positions/2 tokens per max_positions/2 new
tokens instead of a whole window per token. NOTE: positions are absolute (GPT-2)
or rotary over the window, so a slide by one token would invalidate every cached
key; each token's context is therefore between half and all of max_positions.
Generation stops at <|endoftext|> (when the tokenizer has one) or after N new
tokens. Reading checkpoints lives in toolkit/checkpoint/checkpointer.py, the model rebuild in
toolkit/checkpoint/export.py, tokenizers in toolkit/data/tokenizer.py.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.data.tokenizer import TOKENIZER_FILE, TextTokenizer, load_tokenizer_folder, synthetic_tokenizer


@dataclass
class Generator:
    """A model ready to sample from, its tokenizer, and where both came from."""
    model: torch.nn.Module
    tokenizer: TextTokenizer
    source: str
    max_positions: int


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _tokenizer(folder: Path, source: Path) -> TextTokenizer:
    if not (folder / TOKENIZER_FILE).is_file():
        raise UserError(f"{source}: no tokenizer at {folder} (runs save theirs in <run_dir>/tokenizer/ and exports "
                        "of them hold it); pass --tokenizer FOLDER")
    return load_tokenizer_folder(folder, where="tokenizer", need_eot=False)


def load_generator(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None) -> Generator:
    """The model of a run dir (latest checkpoint), checkpoints dir, step dir or exported HF folder, with its tokenizer."""
    from toolkit.checkpoint.export import max_positions

    path = Path(path)
    if path.is_dir() and _is_hf_folder(path):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        tokenizer = _tokenizer(Path(tokenizer_dir) if tokenizer_dir else path, path)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # NOTE: stderr carries one line (describe) and errors, no loading bar
        try:
            model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: cannot load the model: {str(exc).strip().splitlines()[0]}") from None
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        source = str(path)
    else:
        from toolkit.checkpoint.files import find_checkpoint
        from toolkit.checkpoint.resume import load_training_checkpoint
        from toolkit.checkpoint.export import build_hf_model, run_tokenizer_folder

        step_dir = find_checkpoint(path)
        ckpt = load_training_checkpoint(step_dir)
        model = build_hf_model(ckpt)
        data = (ckpt.meta.get("recipe") or {}).get("data") or {}
        folder = Path(tokenizer_dir) if tokenizer_dir else run_tokenizer_folder(ckpt)
        if not tokenizer_dir and data.get("kind") == "synthetic" and not (folder / TOKENIZER_FILE).is_file():
            tokenizer = synthetic_tokenizer(data.get("vocab_size") or model.config.vocab_size)  # an older run
        else:
            tokenizer = _tokenizer(folder, path)
        source = f"{step_dir} (step {ckpt.step})"
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise UserError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab}; "
                        "is it the run's tokenizer?")
    return Generator(model.eval(), tokenizer, source, max_positions(model.config))


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """One token id from last-position logits: greedy at temperature 0, else softmax(logits / T) over the top k."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def slide_window(window: list[int], max_positions: int) -> list[int] | None:
    """The newer half of a window that no longer fits the model's context, else None (the cache goes on)."""
    if len(window) <= max_positions:
        return None
    return window[-max(max_positions // 2, 1):]


@torch.no_grad()
def generate_ids(gen: Generator, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop_at_eot: bool = True, use_cache: bool = True) -> list[int]:
    """The new token ids after `prompt_ids` (an empty prompt starts after <|endoftext|>).

    use_cache=False recomputes the whole window for every token (the reference the cached loop must match).
    """
    eot = gen.tokenizer.eot_id if stop_at_eot else None
    if not prompt_ids and gen.tokenizer.eot_id is None:
        raise ValueError("a tokenizer without an end-of-text token needs a prompt")
    window = (list(prompt_ids) or [gen.tokenizer.eot_id])[-gen.max_positions:]  # the tokens the model sees
    rng = torch.Generator().manual_seed(seed)
    # NOTE: transformers 5 names the KV cache `cache` (argument and output); 4.x `past_key_values`.
    cache_name = "cache" if "cache" in inspect.signature(gen.model.forward).parameters else "past_key_values"
    new: list[int] = []
    past = None
    for _ in range(max_new_tokens):
        if past is None:  # prefill: the whole window (the first step, after a slide, or without the cache)
            out = gen.model(input_ids=torch.tensor([window]), use_cache=use_cache)
        else:
            out = gen.model(input_ids=torch.tensor([[window[-1]]]), use_cache=True, **{cache_name: past})
        past = out.get(cache_name) if use_cache else None
        token = sample_next(out.logits[0, -1], temperature, top_k, rng)
        if eot is not None and token == eot:
            break
        new.append(token)
        window.append(token)
        kept = slide_window(window, gen.max_positions)
        if kept is not None:  # the next position would not fit: keep the newer half, prefill it again
            window, past = kept, None
    return new


def generate_text(gen: Generator, prompt: str, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                  seed: int = 0) -> str:
    """The prompt followed by its sampled continuation."""
    prompt_ids = encode_prompt(gen.tokenizer, prompt)
    if not prompt_ids and gen.tokenizer.eot_id is None:  # synthetic data: start where its sequences start
        start = torch.randint(gen.tokenizer.vocab_size, (1,), generator=torch.Generator().manual_seed(seed))
        prompt_ids = [int(start)]
    new = generate_ids(gen, prompt_ids, max_new_tokens, temperature, top_k, seed)
    # NOTE: decode prompt and continuation together: a BPE or byte token may complete a character.
    return gen.tokenizer.decode(prompt_ids + new)


def encode_prompt(tokenizer: TextTokenizer, prompt: str) -> list[int]:
    """The prompt's ids; a prompt the tokenizer cannot encode (a synthetic run's: ids only) is one line."""
    try:
        return tokenizer.encode(prompt)
    except Exception:  # tokenizers raises a bare Exception for a word outside a word-level vocabulary
        if tokenizer.kind == "synthetic":
            raise UserError(f"--prompt: {prompt!r}: a synthetic run's tokens are its ids 0-{tokenizer.vocab_size - 1} "
                            "separated by spaces (e.g. --prompt \"3 17 42\")") from None
        raise


def check_sampling_args(max_new_tokens: int, temperature: float, top_k: int) -> None:
    """One line per bad sampling argument."""
    problems = []
    if max_new_tokens < 1:
        problems.append(f"--max-new-tokens: {max_new_tokens} must be at least 1")
    if not temperature >= 0:
        problems.append(f"--temperature: {temperature} must be 0 (greedy) or more")
    if top_k < 0:
        problems.append(f"--top-k: {top_k} must be 0 (off) or more")
    if problems:
        raise UserError(*problems)


def describe(gen: Generator) -> str:
    """One line: where the model and tokenizer came from."""
    n = sum(p.numel() for p in gen.model.parameters())
    return (f"model {gen.source}: {n / 1e6:.2f}M parameters, context {gen.max_positions}; tokenizer "
            f"{gen.tokenizer.kind}, {gen.tokenizer.vocab_size} tokens")
