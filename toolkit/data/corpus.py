"""Real-text corpora before tokenization: the path variables a recipe may use,
the list of files a `data` section names, and the documents in them (one per
text file, JSONL line or Parquet row), with one-line errors that say where.

Only regular files are read: a glob's matches that are FIFOs, devices, sockets,
dangling or looping symbolic links are skipped with one warning (reading /dev/zero
or a FIFO would never end), an explicit path to one is an error, and every file is
opened through `open_regular_file`, which checks the opened file again (a FIFO
swapped in after listing is refused, not read).

No torch and no tokenizer here: `toolkit validate` imports this module to check
that the files exist. Tokenizing, caching and packing live in toolkit/data/batches.py.
"""
from __future__ import annotations

import errno
import fnmatch
import glob
import hashlib
import json
import os
import re
import stat
import sys
import sysconfig
from pathlib import Path
from typing import BinaryIO, Iterator

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


def _recursive_glob(pattern: str, exclude: tuple[str, ...], skipped: list[tuple[str, str]]) -> list[str]:
    """Names matching a `**` glob (folders that cannot be listed go to `skipped`); folders that an exclude
    pattern ending in `*` covers are not entered.

    NOTE: glob.glob would walk all of site-packages under ${python_stdlib} (12,000 folders,
    2 s) only for the exclude list to drop it; pruning makes listing the stdlib ~0.1 s.
    """
    root = pattern[:_GLOB_MAGIC.search(pattern).start()].rpartition("/")[0] or "/"
    regex = glob_regex(pattern)
    prunable = tuple(p for p in exclude if p.endswith("*"))
    found = []

    def unlistable(exc: OSError) -> None:  # NOTE: os.walk drops a folder it cannot list unless told
        skipped.append((exc.filename, f"a folder that cannot be listed: {exc.strerror}"))

    for folder, subfolders, names in os.walk(root, onerror=unlistable):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")
                         and not _excluded(os.path.join(folder, d) + "/", prunable)]
        found += [path for path in (os.path.join(folder, n) for n in names) if regex.match(path)]
    return sorted(found)


_FILE_TYPES = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symbolic link"}


def _not_regular(mode: int) -> str:
    return f"not a regular file ({_FILE_TYPES.get(stat.S_IFMT(mode), 'a special file')})"


def regular_file_problem(path: str) -> str | None:
    """Why `path` (symbolic links followed) is no regular file to read, or None if it is; stats, never opens."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            return "no such file"
        try:
            return f"a dangling symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a dangling symbolic link"
    except OSError as exc:  # ELOOP (a link to itself), EACCES on a folder above, ENAMETOOLONG...
        return "a symbolic link that loops" if exc.errno == errno.ELOOP else f"cannot stat: {exc.strerror}"
    return None if stat.S_ISREG(mode) else _not_regular(mode)


def open_regular_file(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file, else a one-line UserError naming it.

    NOTE: opened non-blocking, then checked with fstat: a FIFO that replaced the file after
    it was listed is refused instead of blocking forever on its first read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(f"{path}: {_not_regular(mode)}; only regular files are read")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


_WARNED_ENV = "TOOLKIT_WARNED"


def warn_once(line: str) -> None:
    """Print `warning: line` to stderr once per launch: once per process, on rank 0 only, and not again in
    ranks that `toolkit run --nproc` starts after the launcher printed it."""
    # NOTE: the printed lines' digests go into the environment, which the launcher's ranks inherit.
    digest = hashlib.sha256(line.encode()).hexdigest()[:12]
    warned = os.environ.get(_WARNED_ENV, "").split()
    if digest in warned or os.environ.get("RANK", "0") != "0":
        return
    os.environ[_WARNED_ENV] = " ".join([*warned, digest])
    print(f"warning: {line}", file=sys.stderr, flush=True)


def _skipped_summary(skipped: list[tuple[str, str]]) -> str:
    path, why = skipped[0]
    return f"{len(skipped)} match(es) that are not regular files, e.g. {path}: {why}"


def _glob_matches(pattern: str, exclude: tuple[str, ...], skipped: list[tuple[str, str]]) -> tuple[list[str], int]:
    """A glob's names minus `exclude` (folders dropped, non-regular files moved to `skipped`), and how many
    names it matched before that."""
    if "**" in pattern:
        names = _recursive_glob(pattern, exclude, skipped)
    else:
        names = sorted(p for p in glob.glob(pattern) if not os.path.isdir(p))
    matches = []
    for path in names:
        if _excluded(path, exclude):
            continue
        problem = regular_file_problem(path)
        if problem is None:
            matches.append(path)
        else:
            skipped.append((path, problem))
    return matches, len(names)


def list_files(paths: tuple[str, ...], exclude: tuple[str, ...], where: str = "recipe.data") -> list[Path]:
    """The regular files `paths` (files or globs, `**` recursive) name, minus `exclude`, in a stable order.

    A glob's matches that are not regular files are skipped with one warning; an explicit
    path to one, and a file this process may not read, are errors naming the file.
    """
    files: dict[str, None] = {}
    skipped: list[tuple[str, str]] = []
    for i, pattern in enumerate(paths):
        here = f"{where}.paths[{i}]"
        if _GLOB_MAGIC.search(pattern):
            matches, matched = _glob_matches(pattern, exclude, skipped)
            if not matched:
                raise UserError(f"{here}: {pattern}: the glob matches no file")
        elif os.path.isdir(pattern):
            raise UserError(f"{here}: {pattern}: is a directory; name its files with a glob such as "
                            f"{os.path.join(pattern, '**', '*.txt')}")
        else:
            problem = regular_file_problem(pattern)
            if problem is not None:
                raise UserError(f"{here}: {pattern}: {problem}")
            matches = [] if _excluded(pattern, exclude) else [pattern]
        for path in matches:
            if not os.access(path, os.R_OK):
                raise UserError(f"{here}: {path}: cannot read: permission denied")
        files.update((m, None) for m in matches)
    if not files and skipped:
        raise UserError(f"{where}.paths: no regular file to read: {_skipped_summary(skipped)}")
    if not files:
        raise UserError(f"{where}.exclude: excludes every file that data.paths names")
    if skipped:
        warn_once(f"{where}.paths: skipped {_skipped_summary(skipped)}; only regular files are read")
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
