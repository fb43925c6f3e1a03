"""Tokenizers for real text, all `tokenizers.Tokenizer` objects with one
end-of-text token that separates packed documents:

- `byte`: ids are the UTF-8 bytes (0-255), <|endoftext|> is 256; nothing to train.
- `bpe`: a byte-level BPE (GPT-2's pre-tokenizer) trained with the `tokenizers`
  library on the training documents, up to data.vocab_size tokens.
- `pretrained`: a local Hugging Face tokenizer folder (its tokenizer.json).
- `synthetic`: synthetic data's token ids as words ("17" is id 17), separated by spaces;
  it has no end-of-text token, so it decodes and encodes but cannot pack documents.

Each is saved into the run dir (<run_dir>/tokenizer/, by rank 0) and into exports as
a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json) that
`toolkit generate` and `AutoTokenizer` load and that encodes exactly as the run did
(the byte-level one included: it is a merge-free BPE over GPT-2's byte alphabet).
Caching the trained BPE and the token ids lives in toolkit/data/batches.py. No torch here.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Callable, Iterable

from toolkit.errors import UserError, write_failure

EOT = "<|endoftext|>"
BYTE_VOCAB_SIZE = 257  # 256 bytes + <|endoftext|>
# NOTE: the byte alphabet plus the end-of-text token; a BPE needs at least one merge on top.
MIN_BPE_VOCAB_SIZE = BYTE_VOCAB_SIZE + 1
CONFIG_FILE, TOKENIZER_FILE = "tokenizer_config.json", "tokenizer.json"
RUN_TOKENIZER_DIR = "tokenizer"  # <run_dir>/tokenizer/: the run's tokenizer, for generate and export
# Names a pretrained tokenizer may give its end-of-text token when its config names none.
_EOT_CANDIDATES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the ByteLevel pre-tokenizer's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class TextTokenizer:
    """A `tokenizers.Tokenizer` with its end-of-text id (None for `synthetic`), and what kind it is."""

    def __init__(self, tokenizer, eot_id: int | None, kind: str):
        self.tokenizer, self.eot_id, self.kind = tokenizer, eot_id, kind
        # A document that contains the literal text "<|endoftext|>" stays text: only packing inserts the separator.
        self.tokenizer.encode_special_tokens = True

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eot_token(self) -> str | None:
        return None if self.eot_id is None else self.tokenizer.id_to_token(self.eot_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no separators added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list:
        """Token ids of each text, as numpy arrays (uint8 for byte, else int64); batched in Rust."""
        import numpy as np

        if self.kind == "byte":  # NOTE: the fast path: ids are the bytes (tests check it matches the tokenizer)
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (special tokens included; invalid UTF-8 becomes U+FFFD)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, folder: Path, model_max_length: int | None = None) -> Path:
        """Write a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json), each file atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # NOTE: split_special_tokens makes transformers encode the literal text "<|endoftext|>" as text,
        # as encode() does (tokenizer.json does not store encode_special_tokens).
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eot_token,
                  "bos_token": self.eot_token, "unk_token": None, "split_special_tokens": True,
                  "toolkit_kind": self.kind}
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        _write_atomically(folder / TOKENIZER_FILE, lambda tmp: self.tokenizer.save(str(tmp)))
        _write_atomically(folder / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
        return folder


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temp file beside `path`, then rename it over `path`: a reader sees the old file or the new one."""
    # NOTE: not mkstemp, whose files are private (0600): these keep the umask's permissions like any other.
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        error = write_failure(exc, path)  # the tokenizers library's own errors quote the errno
        if error is not None:
            raise error from None
        raise


def byte_tokenizer() -> TextTokenizer:
    """Byte-level: id = byte value, <|endoftext|> = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return TextTokenizer(tok, tok.token_to_id(EOT), "byte")


def synthetic_tokenizer(vocab_size: int) -> TextTokenizer:
    """Synthetic data's ids as words: id i is the text "i", tokens separated by whitespace; no end-of-text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={str(i): i for i in range(vocab_size)}))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # NOTE: with no decoder, decode joins tokens with spaces
    return TextTokenizer(tok, None, "synthetic")


def train_bpe(documents: Iterable[str], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE trained on `documents`; <|endoftext|> is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents, trainer)
    return TextTokenizer(tok, tok.token_to_id(EOT), "bpe")


def _read_folder_file(path: Path, where: str) -> str:
    """The UTF-8 text of a regular file in a tokenizer folder, or one line naming it."""
    from toolkit.regular_files import open_regular_file

    try:
        with open_regular_file(path) as f:
            data = f.read()
        return data.decode("utf-8")
    except UserError as exc:
        raise UserError(f"{where}: {exc.lines[0]}") from None
    except OSError as exc:
        raise UserError(f"{where}: {path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{where}: {path}: not UTF-8 (byte offset {exc.start}); not a tokenizer file") from None


def _folder_config(folder: Path, where: str) -> dict:
    """eos_token and toolkit_kind from tokenizer_config.json (None and "pretrained" when absent), type-checked."""
    path = folder / CONFIG_FILE
    if not path.exists():
        return {"eos_token": None, "toolkit_kind": "pretrained"}
    text = _read_folder_file(path, where)
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{where}: {path}: malformed JSON: {exc}") from None
    except RecursionError:
        raise UserError(f"{where}: {path}: malformed JSON: nested too deeply") from None
    if not isinstance(config, dict):
        raise UserError(f"{where}: {path}: expected a JSON object, got {type(config).__name__}")
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # an AddedToken written out
        eos = eos.get("content")
    if eos is not None and not isinstance(eos, str):
        raise UserError(f"{where}: {path}: eos_token is {json.dumps(config['eos_token'])[:80]}, expected a token "
                        "string (or an object with a string 'content')")
    kind = config.get("toolkit_kind", "pretrained")
    if kind not in ("byte", "bpe", "pretrained", "synthetic"):
        raise UserError(f"{where}: {path}: toolkit_kind is {json.dumps(kind)[:80]}, expected byte, bpe, pretrained "
                        "or synthetic")
    return {"eos_token": eos, "toolkit_kind": kind}


def _eot_of_folder(folder: Path, tok, name: str | None) -> int:
    for candidate in ([name] if name else []) + list(_EOT_CANDIDATES):
        token_id = tok.token_to_id(candidate)
        if token_id is not None:
            return token_id
    raise UserError(f"{folder}: the tokenizer has no end-of-text token (no eos_token in {CONFIG_FILE}, none of "
                    f"{', '.join(_EOT_CANDIDATES)}); packing needs one to separate documents")


def load_tokenizer_folder(folder: Path, where: str = "recipe.data.tokenizer_path",
                          need_eot: bool = True) -> TextTokenizer:
    """A Hugging Face tokenizer folder (tokenizer.json; eos_token from tokenizer_config.json).

    need_eot=False (decoding only) also accepts a synthetic run's tokenizer, which has no end-of-text token.
    Every problem with its files is one line naming `where` and the file.
    """
    from tokenizers import Tokenizer

    folder = Path(folder)
    path = folder / TOKENIZER_FILE
    if not path.exists() and not path.is_symlink():
        raise UserError(f"{where}: {folder}: no {TOKENIZER_FILE} there (save a fast tokenizer with "
                        "AutoTokenizer.from_pretrained(...).save_pretrained(folder))")
    text = _read_folder_file(path, where)
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise UserError(f"{where}: {path}: cannot load: {str(exc).splitlines()[0][:200]}") from None
    config = _folder_config(folder, where)
    if config["toolkit_kind"] == "synthetic" and not need_eot:
        return TextTokenizer(tok, None, "synthetic")
    return TextTokenizer(tok, _eot_of_folder(folder, tok, config.get("eos_token")), config["toolkit_kind"])


def pretrained_vocab_size(folder: Path, where: str) -> int:
    """The vocabulary (added tokens included) of a tokenizer folder, for the model's embedding."""
    return load_tokenizer_folder(folder, where).vocab_size


def run_tokenizer_dir(step_dir: Path, checkpoint_dir: str = "checkpoints") -> Path:
    """<run_dir>/tokenizer for a step dir <run_dir>/<checkpoint_dir>/step-NNNNNN (checkpoint.dir may be nested)."""
    step_dir, checkpoint_dir = Path(step_dir), Path(checkpoint_dir)
    depth = 1 if checkpoint_dir.is_absolute() else max(len(checkpoint_dir.parts), 1)
    return step_dir.parents[min(depth, len(step_dir.parents) - 1)] / RUN_TOKENIZER_DIR
