"""Real-text corpora before tokenization: the documents in the files a `data`
section names (one per text file, JSONL line or Parquet row), with one-line errors
that say where, and the fingerprint of those files' bytes.

Every file is opened through `open_regular_file` (toolkit/regular_files.py), which
checks the opened file again: a FIFO swapped in after the files were listed
(toolkit/data/paths.py) is refused, not read.

No torch and no tokenizer here. Tokenizing, caching and packing live in
toolkit/data/batches.py.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Iterator

from toolkit.errors import UserError
from toolkit.regular_files import open_regular_file

# A *record* is a text file, a JSONL line or a Parquet row; its text is one document (blank
# ones are skipped). Records are numbered in file order, which is what the validation split draws from.


def _decode(data: bytes, errors: str, where: str, line: int = 1, offset: int = 0) -> str:
    """UTF-8 text of `data`, which starts at `line` and byte `offset` of the file `where` names."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if errors != "replace":
            line += data.count(b"\n", 0, exc.start)
            raise UserError(f"{where}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset "
                            f"{offset + exc.start}); fix the file or set data.errors to 'replace'") from None
        text = data.decode("utf-8", errors="replace")
    return text[1:] if offset == 0 and text.startswith("\ufeff") else text


def _json_type(value) -> str:
    names = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _jsonl_documents(path: Path, field: str, errors: str) -> Iterator[str]:
    # NOTE: lines are cut at b"\n" as bytes (never inside a UTF-8 sequence), one at a time, so a
    # large file streams; str.splitlines would also cut at U+2028, which JSON allows inside strings.
    offset = 0
    with open_regular_file(path) as f:
        for number, raw in enumerate(f, start=1):
            line = _decode(raw, errors, str(path), number, offset)
            offset += len(raw)
            if line.strip():
                yield _jsonl_text(path, number, line, field, errors)


def _jsonl_text(path: Path, number: int, line: str, field: str, errors: str) -> str:
    """The `field` of one JSONL line, or a one-line error naming file and line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{number}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:  # json recurses once per [ or {: a line like [[[[...]]]] exhausts the stack
        raise UserError(f"{path}:{number}: nested too deeply (more levels of [ and {{ than Python's "
                        f"recursion limit, {sys.getrecursionlimit()})") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}:{number}: expected a JSON object with field '{field}', got {_json_type(record)}")
    if field not in record:
        known = ", ".join(list(record)[:8]) or "none"
        raise UserError(f"{path}:{number}: no field '{field}' (fields: {known}); set data.field")
    value = record[field]
    if not isinstance(value, str):
        raise UserError(f"{path}:{number}: field '{field}' is {_json_type(value)}, expected a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON can escape half a surrogate pair (\ud83d), which is no character
        if errors != "replace":
            raise UserError(f"{path}:{number}: field '{field}' holds a lone surrogate escape at character "
                            f"{exc.start}; fix the file or set data.errors to 'replace'") from None
        value = value.encode("utf-8", "replace").decode("utf-8")
    return value


def _parquet_documents(path: Path, column: str, errors: str) -> Iterator[str]:
    pq = import_pyarrow_parquet()
    import pyarrow as pa

    with open_regular_file(path) as f:
        try:
            parquet = pq.ParquetFile(f)
            yield from _parquet_column(parquet, path, column, errors)
        except (pa.ArrowException, OSError) as exc:  # a bad footer, or a damaged page met while reading
            raise UserError(f"{path}: not a readable Parquet file: {str(exc).splitlines()[0]}") from None


def _parquet_column(parquet, path: Path, column: str, errors: str) -> Iterator[str]:
    import pyarrow as pa

    names = parquet.schema_arrow.names
    if column not in names:
        raise UserError(f"{path}: no column '{column}' (columns: {', '.join(names[:8])}); set data.column")
    kind = parquet.schema_arrow.field(column).type
    binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    if not (binary or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"{path}: column '{column}' holds {kind}, expected strings")
    row = 0
    for batch in parquet.iter_batches(columns=[column], batch_size=8192):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None:
                continue
            yield _decode(value, errors, f"{path}: row {row}") if binary else value


def import_pyarrow_parquet():
    """pyarrow.parquet, or a one-line error saying how to install it."""
    from toolkit.optional_packages import require_package

    require_package("pyarrow")
    import pyarrow.parquet as pq

    return pq


def read_documents(kind: str, path: Path, *, field: str | None, column: str | None,
                   errors: str) -> Iterator[str]:
    """The non-empty documents of one file, in order; a read error is one line naming the file."""
    if kind == "text":
        docs: Iterator[str] = _text_documents(path, errors)
    elif kind == "jsonl":
        docs = _jsonl_documents(path, field, errors)
    elif kind == "parquet":
        docs = _parquet_documents(path, column, errors)
    else:
        raise ValueError(f"not a real-text data kind: {kind}")
    try:
        yield from (doc for doc in docs if doc)
    except OSError as exc:  # EIO, a file truncated or removed while read, a network mount gone
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _text_documents(path: Path, errors: str) -> Iterator[str]:
    with open_regular_file(path) as f:
        data = f.read()
    yield _decode(data, errors, str(path))


def fingerprint_files(files: list[Path], settings: dict) -> str:
    """sha256 over every file's name and bytes and the settings that change what is read from them."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        digest.update(str(path).encode() + b"\0")
        file_digest = hashlib.sha256()
        with open_regular_file(path) as f:
            try:
                for block in iter(lambda: f.read(1 << 20), b""):
                    file_digest.update(block)
            except OSError as exc:
                raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
        digest.update(file_digest.digest())
    return digest.hexdigest()
