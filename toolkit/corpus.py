"""Real-text corpora before tokenization: the path variables a recipe may use,
the list of files a `data` section names, and the documents in them (one per
text file, JSONL line or Parquet row), with one-line errors that say where.

No torch and no tokenizer here: `toolkit validate` imports this module to check
that the files exist. Tokenizing, caching and packing live in toolkit/data.py.
"""
from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterator

from toolkit.errors import UserError

# The variables `${name}` a path in a recipe may use; the schema's descriptions and the
# README list the same names (tests/test_data_recipes.py checks that they agree).
PATH_VARIABLES = {
    "python_stdlib": "the running Python's standard library folder (sysconfig 'stdlib')",
    "recipe_dir": "the folder of the recipe file (the working directory for a recipe built in Python)",
    "cwd": "the working directory toolkit runs in",
    "home": "the user's home folder",
    "cache": "$XDG_CACHE_HOME, else ~/.cache",
}
_VARIABLE = re.compile(r"\$\{([^}]*)\}")
_GLOB_MAGIC = re.compile(r"[*?[]")


def variable_values(recipe_dir: Path | None) -> dict[str, str]:
    """What each path variable stands for on this machine."""
    return {
        "python_stdlib": sysconfig.get_paths()["stdlib"],
        "recipe_dir": str(recipe_dir if recipe_dir is not None else Path.cwd()),
        "cwd": str(Path.cwd()),
        "home": str(Path.home()),
        "cache": os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache"),
    }


def expand_path(value: str, where: str, recipe_dir: Path | None) -> str:
    """`value` with its ${variables} replaced; relative results are taken from the recipe's folder."""
    values = variable_values(recipe_dir)

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise UserError(f"{where}: unknown path variable ${{{name}}} in {value!r} "
                            f"(known: {', '.join('${' + k + '}' for k in PATH_VARIABLES)})")
        return values[name]

    expanded = os.path.expanduser(_VARIABLE.sub(substitute, value))
    if not os.path.isabs(expanded):
        expanded = os.path.join(values["recipe_dir"], expanded)
    return os.path.normpath(expanded)


def _excluded(path: str, exclude: tuple[str, ...]) -> bool:
    posix = path.replace(os.sep, "/")
    return any(fnmatch.fnmatchcase(posix, pattern) for pattern in exclude)


def glob_regex(pattern: str) -> re.Pattern:
    """A glob as a regex over whole paths: `**/` is any number of folders, `*` and `?` stay
    inside one name, and (as in glob) no wildcard matches a name that starts with a dot."""
    out, i, component_start = [], 0, True
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append(r"(?:(?!\.)[^/]*/)*")
            i += 3
            continue
        c = pattern[i]
        hidden_guard = r"(?!\.)" if component_start else ""
        if c == "*":
            out.append(hidden_guard + r"[^/]*")
        elif c == "?":
            out.append(hidden_guard + r"[^/]")
        elif c == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end].replace("\\", "\\\\")
            body = "^" + body[1:] if body.startswith("!") else "\\" + body if body.startswith("^") else body
            out.append(hidden_guard + "[" + body + "]")
            i = end
        else:
            out.append(re.escape(c))
        component_start = c == "/"
        i += 1
    return re.compile("".join(out) + r"\Z")


def _recursive_glob(pattern: str, exclude: tuple[str, ...]) -> list[str]:
    """Files matching a `**` glob; folders that an exclude pattern ending in `*` covers are not entered.

    NOTE: glob.glob would walk all of site-packages under ${python_stdlib} (12,000 folders,
    2 s) only for the exclude list to drop it; pruning makes listing the stdlib ~0.1 s.
    """
    root = pattern[:_GLOB_MAGIC.search(pattern).start()].rpartition("/")[0] or "/"
    regex = glob_regex(pattern)
    prunable = tuple(p for p in exclude if p.endswith("*"))
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")
                         and not _excluded(os.path.join(folder, d) + "/", prunable)]
        found += [path for path in (os.path.join(folder, n) for n in names) if regex.match(path)]
    return sorted(found)


def list_files(paths: tuple[str, ...], exclude: tuple[str, ...], where: str = "recipe.data") -> list[Path]:
    """The files `paths` (files or globs, `**` recursive) name, minus `exclude`, in a stable order."""
    files: dict[str, None] = {}
    for i, pattern in enumerate(paths):
        here = f"{where}.paths[{i}]"
        if _GLOB_MAGIC.search(pattern):
            if "**" in pattern:
                matches = _recursive_glob(pattern, exclude)
            else:
                matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise UserError(f"{here}: {pattern}: the glob matches no file")
        elif os.path.isdir(pattern):
            raise UserError(f"{here}: {pattern}: is a directory; name its files with a glob such as "
                            f"{os.path.join(pattern, '**', '*.txt')}")
        elif not os.path.isfile(pattern):
            raise UserError(f"{here}: {pattern}: no such file")
        else:
            matches = [pattern]
        files.update((m, None) for m in matches if not _excluded(m, exclude))
    if not files:
        raise UserError(f"{where}.exclude: excludes every file that data.paths names")
    return [Path(p) for p in files]


# ---------------------------------------------------------------------------
# Reading documents. A *record* is a text file, a JSONL line or a Parquet row; its
# text is one document (blank ones are skipped). Records are numbered in file order,
# which is what the validation split draws from.


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
    with open(path, "rb") as f:
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

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: not a readable Parquet file: {str(exc).splitlines()[0]}") from None
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
    """The non-empty documents of one file, in order."""
    if kind == "text":
        text = _decode(path.read_bytes(), errors, str(path))
        docs: Iterator[str] = iter([text])
    elif kind == "jsonl":
        docs = _jsonl_documents(path, field, errors)
    elif kind == "parquet":
        docs = _parquet_documents(path, column, errors)
    else:
        raise ValueError(f"not a real-text data kind: {kind}")
    return (doc for doc in docs if doc)


def fingerprint_files(files: list[Path], settings: dict) -> str:
    """sha256 over every file's name and bytes and the settings that change what is read from them."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        digest.update(str(path).encode() + b"\0")
        file_digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                file_digest.update(block)
        digest.update(file_digest.digest())
    return digest.hexdigest()
