"""Training data as micro batches of token ids, shape [micro, seq_len + 1]
(inputs are [:, :-1], targets [:, 1:]).

`synthetic`: a seeded random Markov chain over `vocab_size` tokens where each
token has `branching` equally likely successors, so the best achievable loss is
ln(branching) nats while an untrained model starts near ln(vocab_size).

`text`, `jsonl`, `parquet`: documents (toolkit/data/corpus.py) are split into training
and validation by a seeded hash of each document's text, tokenized once
(toolkit/data/tokenizer.py) and cached as two flat token files, each document followed
by the end-of-text token. The cache is keyed by the files' bytes and every setting
that changes the tokens, and read back memory-mapped: sequence i is the window
tokens[i * seq_len : i * seq_len + seq_len + 1], a view, so packing copies nothing.

`BatchStream` walks a per-epoch permutation (seeded by training.seed and the
epoch) one global batch per optimizer step; rank r's micro-step m takes slots
[(m * world + r) * micro, ... + micro) of it, so ranks never overlap and the
samples of a step do not depend on how the global batch is split. Its position
(epoch, step in epoch) is what a checkpoint saves.

Several processes (torchrun, `toolkit run --nproc N`): every rank reads the same
cache; one builds each entry (a file lock, then a temp dir renamed into place;
toolkit/data/cache.py) and the others load it. Rank 0 alone writes the tokenizer
into the run dir.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from toolkit.data.cache import (CACHE_FORMAT, build_lock, cache_dir, cache_key, cached_token_meta, publish_entry,
                                read_tokens, set_aside_damaged)
from toolkit.data.corpus import fingerprint_files, read_documents
from toolkit.data.paths import list_files
from toolkit.errors import UserError, warn_once
from toolkit.specs import BatchSpec, DataSpec
from toolkit.data.tokenizer import (RUN_TOKENIZER_DIR, TextTokenizer, byte_tokenizer, load_tokenizer_folder,
                               synthetic_tokenizer, train_bpe)

_CHUNK_CHARS = 4_000_000  # documents tokenized per encode_batch call (bounded memory, parallel in Rust)


def markov_chain_tokens(spec: DataSpec, num_samples: int, stream: int) -> torch.Tensor:
    """[num_samples, seq_len + 1] int64 tokens from the recipe's chain; `stream` picks independent samples."""
    chain_gen = torch.Generator().manual_seed(spec.seed)
    successors = torch.randint(0, spec.vocab_size, (spec.vocab_size, spec.branching), generator=chain_gen)
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + 7919 * (stream + 1))
    first = torch.randint(0, spec.vocab_size, (num_samples,), generator=gen)
    # NOTE: randint draws the same values whatever the integer dtype (one 32-bit draw per element, then modulo), so
    # the choices and the chain are held small: uint8 / int32 move a quarter / half of int64's bytes through the
    # transposes and gathers (124M's data: 1.09 -> 0.61 s on the 2-core VM, the same tokens;
    # benchmarks/synthetic_data.py).
    small = torch.uint8 if spec.branching <= 256 else torch.long
    choices = torch.randint(0, spec.branching, (num_samples, spec.seq_len), generator=gen, dtype=small).T.contiguous()
    token = torch.int32 if spec.vocab_size * spec.branching < 2**31 else torch.long  # index arithmetic fits
    # NOTE: built position by position in a [seq_len + 1, num_samples] layout, whose rows are contiguous: the
    # same tokens as column by column in [num_samples, seq_len + 1], in half the time (1.56 -> 0.76 s, 124M's data)
    flat_successors = successors.reshape(-1).to(token)
    columns = torch.empty(spec.seq_len + 1, num_samples, dtype=token)
    columns[0] = first
    for t in range(spec.seq_len):
        torch.index_select(flat_successors, 0, columns[t] * spec.branching + choices[t], out=columns[t + 1])
    return columns.T.contiguous().long()


# ---------------------------------------------------------------------------
# Real text: split, tokenize once, cache.


def in_validation(doc: str, fraction: float, seed: int) -> bool:
    """Whether a document is held out: a seeded hash of its text below `fraction`.

    NOTE: by content, not position: adding files never moves another document across
    the split, and duplicated documents land on the same side (no leak into validation).
    """
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(doc.encode("utf-8", "surrogatepass"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") < fraction * 2.0 ** 64


def _documents(spec: DataSpec, files: list[Path]) -> Iterator[str]:
    for path in files:
        yield from read_documents(spec.kind, path, field=spec.field, column=spec.column, errors=spec.errors)


def process_rank() -> int:
    """This process's rank: the joined group's, else torchrun's RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    from toolkit.distributed import launched_world

    return launched_world()[0]


def build_tokenizer(spec: DataSpec, files: list[Path], corpus_key: str, log: Callable[[str], None]) -> TextTokenizer:
    """The recipe's tokenizer; a BPE is trained on the training documents once and cached."""
    if spec.tokenizer == "byte":
        return byte_tokenizer()
    if spec.tokenizer == "pretrained":
        return load_tokenizer_folder(spec.tokenizer_path)
    import tokenizers

    key = cache_key({"bpe": spec.vocab_size, "corpus": corpus_key, "validation_fraction": spec.validation_fraction,
                     "seed": spec.seed, "tokenizers": tokenizers.__version__})
    folder = cache_dir(spec) / f"bpe-{key}"
    with build_lock(folder):
        if folder.exists():
            try:
                return load_tokenizer_folder(folder, where="recipe.data.cache_dir")
            except UserError as exc:
                set_aside_damaged(folder, exc.lines[0])
        start = time.perf_counter()
        train_docs = (d for d in _documents(spec, files) if not in_validation(d, spec.validation_fraction, spec.seed))
        tokenizer = train_bpe(train_docs, spec.vocab_size)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-bpe-{key}-", dir=folder.parent))
        tokenizer.save(tmp)
        publish_entry(tmp, folder)
    log(f"data    | trained a BPE tokenizer to {tokenizer.vocab_size} tokens in {time.perf_counter() - start:.1f}s "
        f"-> {folder}")
    return tokenizer


def _token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _write_token_files(spec: DataSpec, files: list[Path], tokenizer: TextTokenizer, out: Path) -> dict:
    """Tokenize every document into out/train.bin and out/valid.bin (each followed by end-of-text)."""
    dtype = _token_dtype(tokenizer.vocab_size)
    eot = np.array([tokenizer.eot_id], dtype=dtype)
    counts = {"train": [0, 0], "valid": [0, 0]}  # tokens, documents
    unigram = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    with open(out / "train.bin", "wb") as train_f, open(out / "valid.bin", "wb") as valid_f:
        sinks = {"train": train_f, "valid": valid_f}

        def flush(chunk: list[str]) -> None:
            encoded = tokenizer.encode_batch(chunk)
            held_out = [in_validation(doc, spec.validation_fraction, spec.seed) for doc in chunk]
            for split in ("train", "valid"):
                parts = []
                for ids, held in zip(encoded, held_out):
                    if held == (split == "valid"):
                        parts += [ids.astype(dtype, copy=False), eot]
                if parts:
                    packed = np.concatenate(parts)
                    packed.tofile(sinks[split])
                    counts[split][0] += len(packed)
                    counts[split][1] += len(parts) // 2
                    if split == "train":
                        unigram[:] += np.bincount(packed, minlength=len(unigram))

        chunk, chars = [], 0
        for doc in _documents(spec, files):
            chunk.append(doc)
            chars += len(doc)
            if chars >= _CHUNK_CHARS:
                flush(chunk)
                chunk, chars = [], 0
        if chunk:
            flush(chunk)
    p = unigram[unigram > 0] / max(unigram.sum(), 1)
    return {"format": CACHE_FORMAT, "dtype": np.dtype(dtype).name, "eot_id": tokenizer.eot_id,
            "vocab_size": tokenizer.vocab_size, "files": len(files),
            "train_tokens": counts["train"][0], "train_documents": counts["train"][1],
            "valid_tokens": counts["valid"][0], "valid_documents": counts["valid"][1],
            "unigram_entropy": float(-(p * np.log(p)).sum())}


class TokenCorpus:
    """A real-text corpus tokenized once: memory-mapped train/valid token streams, the tokenizer, statistics."""

    def __init__(self, spec: DataSpec, log: Callable[[str], None] | None = None):
        log = log or (lambda line: None)
        self.files = list_files(spec.paths, spec.exclude)
        settings = {"kind": spec.kind, "field": spec.field, "column": spec.column, "errors": spec.errors}
        corpus_key = fingerprint_files(self.files, settings)
        self.tokenizer = build_tokenizer(spec, self.files, corpus_key, log)
        self.key = cache_key({"format": CACHE_FORMAT, "corpus": corpus_key,
                              "tokenizer": hashlib.sha256(self.tokenizer.tokenizer.to_str().encode()).hexdigest(),
                              "eot": self.tokenizer.eot_id, "validation_fraction": spec.validation_fraction,
                              "seed": spec.seed})
        self.dir = cache_dir(spec) / f"tokens-{self.key}"
        with build_lock(self.dir):
            self.meta = cached_token_meta(self.dir)
            self.built = self.meta is None
            if self.built:
                self.meta = self._build(spec, log)
        if self.meta["train_documents"] + self.meta["valid_documents"] == 0:
            raise UserError(f"recipe.data.paths: the {len(self.files)} file(s) hold no text (empty corpus)")
        self.train = read_tokens(self.dir / "train.bin", self.meta["dtype"], self.meta["train_tokens"])
        self.valid = read_tokens(self.dir / "valid.bin", self.meta["dtype"], self.meta["valid_tokens"])

    def _build(self, spec: DataSpec, log: Callable[[str], None]) -> dict:
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-tokens-{self.key}-", dir=self.dir.parent))
        try:
            meta = _write_token_files(spec, self.files, self.tokenizer, tmp)
            meta["tokenize_s"] = round(time.perf_counter() - start, 3)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish_entry(tmp, self.dir)
        log(f"data    | tokenized {len(self.files)} files in {meta['tokenize_s']:.1f}s -> {self.dir}")
        return meta


class PackedSequences:
    """Sequences of seq_len + 1 tokens over a token stream; neighbours share one token, so every
    token but the first is a target exactly once. Indexed like a [n, seq_len + 1] int64 tensor."""

    def __init__(self, tokens: np.ndarray, seq_len: int, order: np.ndarray | None = None, source: str | None = None):
        self.source = source  # the token cache key: which corpus and tokenizer the sequences come from
        count = max((len(tokens) - 1) // seq_len, 0)
        item = tokens.dtype.itemsize
        self.windows = np.lib.stride_tricks.as_strided(tokens, shape=(count, seq_len + 1),
                                                       strides=(seq_len * item, item), writeable=False)
        self.order = order  # an optional fixed reordering (evaluation spreads over the whole split)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        if self.order is not None:
            index = self.order[index]
        return torch.from_numpy(self.windows[index].astype(np.int64))


class Dataset:
    """Train and eval sequences for a DataSpec; for real text also its tokenizer."""

    def __init__(self, spec: DataSpec, run_dir: str | os.PathLike | None = None,
                 log: Callable[[str], None] | None = None):
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.tokenizer: TextTokenizer | None = None
        self.corpus: TokenCorpus | None = None
        if spec.kind == "synthetic":
            self.train = markov_chain_tokens(spec, spec.num_samples, stream=0)
            self.eval = markov_chain_tokens(spec, spec.eval_samples, stream=1)
            if run_dir is not None and process_rank() == 0:  # ids as words, for `toolkit generate` and exports
                synthetic_tokenizer(spec.vocab_size).save(Path(run_dir) / RUN_TOKENIZER_DIR)
            return
        self.corpus = corpus = TokenCorpus(spec, log)
        self.tokenizer = corpus.tokenizer
        if corpus.tokenizer.vocab_size > spec.vocab_size:  # a pretrained folder edited since validation
            raise UserError(f"recipe.data.tokenizer_path: the tokenizer has {corpus.tokenizer.vocab_size} tokens, "
                            f"more than the model's {spec.vocab_size}")
        need = spec.seq_len + 1
        if len(corpus.train) < need:
            raise UserError(f"recipe.data.paths: the training split holds {len(corpus.train)} tokens, fewer than one "
                            f"sequence (data.seq_len + 1 = {need}); add text or lower data.seq_len")
        if spec.validation_fraction > 0 and len(corpus.valid) < need:
            raise UserError(f"recipe.data.validation_fraction: the validation split holds {len(corpus.valid)} tokens "
                            f"({corpus.meta['valid_documents']} documents), fewer than one sequence of {need}; "
                            "raise it, add documents, or set it to 0")
        self.train = PackedSequences(corpus.train, spec.seq_len, source=corpus.key)
        eval_count = max((len(corpus.valid) - 1) // spec.seq_len, 0)
        self.eval = PackedSequences(corpus.valid, spec.seq_len,
                                    order=np.random.default_rng(spec.seed).permutation(eval_count))
        if run_dir is not None and process_rank() == 0:
            # NOTE: no barrier: the other ranks hold the same tokenizer (from the same cache entry) and never
            # read this copy; each file is replaced atomically, so a reader (generate, export) sees a whole one.
            self.tokenizer.save(Path(run_dir) / RUN_TOKENIZER_DIR)

    @property
    def entropy_floor(self) -> float:
        """synthetic: the best achievable loss in nats."""
        return math.log(self.spec.branching)

    @property
    def unigram_entropy(self) -> float:
        """Real text: entropy of the training tokens' unigram distribution, nats (the loss of a context-free model)."""
        return self.corpus.meta["unigram_entropy"]

    def loss_reference(self) -> str:
        """The loss to compare with: the chain's floor, or the corpus's unigram entropy."""
        if self.corpus is None:
            return f"floor ln({self.spec.branching}) = {self.entropy_floor:.3f}"
        return f"unigram entropy {self.unigram_entropy:.3f}"

    def describe(self) -> str:
        """One line for the start-up table."""
        d = self.spec
        if self.corpus is None:
            return (f"{d.kind}: {d.num_samples} x {d.seq_len} tokens, vocab {d.vocab_size}, "
                    f"loss {self.loss_reference()}")
        m = self.corpus.meta
        return (f"{d.kind}: {m['files']} files, {m['train_documents']} + {m['valid_documents']} held-out documents "
                f"= {m['train_tokens']:,} + {m['valid_tokens']:,} tokens ({len(self.train):,} + {len(self.eval):,} "
                f"sequences of {d.seq_len}); tokenizer {d.tokenizer}, vocab {self.tokenizer.vocab_size} "
                f"(model {d.vocab_size}); {self.loss_reference()}")


class BatchStream:
    """Resumable, rank-sharded micro batches over epochs of sequences (a tensor or PackedSequences)."""

    def __init__(self, tokens, batch: BatchSpec, rank: int, seed: int):
        self.tokens, self.batch, self.rank, self.seed = tokens, batch, rank, seed
        self.steps_per_epoch = len(tokens) // batch.global_batch
        if self.steps_per_epoch == 0:
            raise UserError(f"recipe.data: the training data holds {len(tokens)} sequences, fewer than one global "
                            f"batch ({batch.global_batch}); add text, or lower data.seq_len or the batch size")
        self.epoch, self.step_in_epoch = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor | np.ndarray:
        gen = torch.Generator().manual_seed(self.seed * 7_368_787 + epoch)
        perm = torch.randperm(len(self.tokens), generator=gen)
        # NOTE: packed sequences are gathered by numpy: slicing a numpy view of the same
        # permutation costs a tenth of slicing the tensor, which matters for small micro batches.
        return perm.numpy() if isinstance(self.tokens, PackedSequences) else perm

    def next_step(self) -> list[torch.Tensor]:
        """This rank's grad_accum_steps micro batches for the next optimizer step."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        b = self.batch
        base = self.step_in_epoch * b.global_batch
        micro_batches = []
        for m in range(b.grad_accum_steps):
            start = base + (m * b.world_size + self.rank) * b.micro_batch_per_rank
            micro_batches.append(self.tokens[self._perm[start:start + b.micro_batch_per_rank]])
        self.step_in_epoch += 1
        return micro_batches

    def state_dict(self) -> dict:
        """Position in the stream (plain ints) for checkpoints, and which corpus it is a position in."""
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "sequences": len(self.tokens),
                "corpus": getattr(self.tokens, "source", None)}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where a saved stream stopped."""
        saved = state.get("sequences")
        if saved is not None and int(saved) != len(self.tokens):
            raise UserError(f"resume: the checkpoint's data position is for {int(saved)} training sequences, the data "
                            f"now gives {len(self.tokens)} (the corpus or its tokenizer changed); start fresh with "
                            "checkpoint.resume=never")
        corpus = getattr(self.tokens, "source", None)
        if state.get("corpus") and corpus and state["corpus"] != corpus:  # same count, other tokens
            warn_once("resume: the corpus changed since the checkpoint (its files' bytes or the tokenizer; same "
                      "number of sequences): the saved data position now walks other sequences")
        epoch, step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step_in_epoch <= self.steps_per_epoch:
            raise UserError(f"resume: the checkpoint's data position (epoch {epoch}, step {step_in_epoch} of the "
                            f"epoch) is outside this data ({self.steps_per_epoch} steps per epoch); a hand-edited "
                            "checkpoint?")
        self.epoch, self.step_in_epoch = epoch, step_in_epoch
        self._perm = self._permutation(self.epoch)


def eval_batches(tokens, batch: BatchSpec, rank: int, count: int) -> list[torch.Tensor]:
    """The same `count` micro batches of held-out data at every evaluation, sharded by rank."""
    micro, world = batch.micro_batch_per_rank, batch.world_size
    usable = len(tokens) // (micro * world)
    if count > 0 and len(tokens) > 0 and usable == 0:
        raise UserError(f"recipe.training.eval_batches: the held-out data holds {len(tokens)} sequences, fewer than "
                        f"one micro batch on every rank ({micro} x {world}); hold out more or set it to 0")
    out = []
    for i in range(min(count, usable)):
        start = (i * world + rank) * micro
        out.append(tokens[start:start + micro])
    return out
