"""A checkpoint directory on disk and its integrity: the file names, fsync, sha256,
atomic writes (temp dir, fsync, rename; pointer files), verification against
manifest.json, and finding, listing and pruning (keep_last) step directories.
Writing and reading the state itself is toolkit/checkpoint/io.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from toolkit.errors import UserError

FORMAT = "toolkit-checkpoint"
FORMAT_VERSION = 1
TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
TEMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """step-000200: zero padded so names sort by step."""
    return f"step-{step:06d}"


# ---------------------------------------------------------------------------
# Files: fsync, checksums, atomic writes

def fsync_file(path: Path) -> None:
    """Flush a written file to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename in it) to the disk, where the platform allows."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # NOTE: some platforms (Windows) cannot open a directory; rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json(path: Path, obj) -> None:
    """Write `obj` as JSON and fsync the file."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def write_pointer(path: Path, name: str) -> None:
    """Replace a small text file atomically: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f"{TEMP_PREFIX}{path.name}-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """A fresh `.tmp-*` directory in `parent`, with the permissions a plain mkdir would give (mkdtemp gives 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{prefix}-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def remove_dir(path: Path) -> None:
    """Rename out of sight first, so a crash mid-delete never leaves a step dir with missing files."""
    doomed = path.with_name(f"{TEMP_PREFIX}delete-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ---------------------------------------------------------------------------
# Structure: what a JSON file of a checkpoint must hold (hand-edited ones are checked, not trusted)

class MapOf:
    """Structure spec: a JSON object whose every value matches `spec`."""

    def __init__(self, spec):
        self.spec = spec


_WORDS = {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "an object",
          list: "a list", tuple: "a list", type(None): "null", object: "a value"}


def _word(kind) -> str:
    return _WORDS.get(kind, f"a {kind.__name__.lower()}")


def structure_problem(value, spec, path: str = "") -> str | None:
    """Where `value` first differs from `spec`, as `path: what`, or None. A spec is a type or a tuple of types,
    a dict of keys (a key ending in ? is optional), `[spec]` for a list, or `MapOf(spec)`."""
    def at(key) -> str:
        return f"{path}.{key}" if path else str(key)

    if isinstance(spec, MapOf):
        if not isinstance(value, dict):
            return f"{path or 'the file'}: is {_word(type(value))}, expected an object"
        return next((p for k, v in value.items() if (p := structure_problem(v, spec.spec, at(k)))), None)
    if isinstance(spec, list):
        if not isinstance(value, (list, tuple)):
            return f"{path}: is {_word(type(value))}, expected a list"
        return next((p for i, v in enumerate(value) if (p := structure_problem(v, spec[0], at(i)))), None)
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{path or 'the file'}: is {_word(type(value))}, expected an object"
        for key, sub in spec.items():
            name = key.rstrip("?")
            if name not in value:
                if key.endswith("?"):
                    continue
                return f"{at(name)}: missing"
            problem = structure_problem(value[name], sub, at(name))
            if problem:
                return problem
        return None
    kinds = spec if isinstance(spec, tuple) else (spec,)
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return None
    return f"{path}: is {_word(type(value))}, expected {' or '.join(_word(k) for k in kinds)}"


_MANIFEST = {"step": int, "files": MapOf({"sha256": str, "bytes": int})}
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_plain_file_name(name: str) -> bool:
    """A name of a file inside the checkpoint directory itself (no folders, no `..`, not hidden)."""
    return bool(name) and os.path.basename(name) == name and "\\" not in name and not name.startswith(".")


def _check_manifest(path: Path, manifest: dict) -> None:
    problem = structure_problem(manifest, _MANIFEST)
    if problem:
        raise UserError(f"{path}: {problem} (a hand-edited or foreign manifest)")
    for name, entry in manifest["files"].items():
        if not is_plain_file_name(name):
            raise UserError(f"{path}: files: {name!r} is not a file of the checkpoint directory")
        if not _SHA256.fullmatch(entry["sha256"]) or entry["bytes"] < 0:
            raise UserError(f"{path}: files.{name}: not a sha256 (64 hex digits) and a byte count")
    for name in (TENSORS_FILE, STATE_FILE):
        if name not in manifest["files"]:
            raise UserError(f"{path}: files: lacks {name}, which every checkpoint holds")


# ---------------------------------------------------------------------------
# Verifying: every file against the manifest

def read_checkpoint_json(path: Path, what: str) -> dict:
    """A toolkit checkpoint JSON file (format and version checked), or one line naming it."""
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: not a regular file ({what})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: corrupt checkpoint file ({what}): {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise UserError(f"{path}: corrupt checkpoint file ({what}): nested too deeply") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path}: not a toolkit checkpoint file ({what})")
    if data.get("version") != FORMAT_VERSION:
        raise UserError(f"{path}: checkpoint format version {data.get('version')!r}; "
                        f"this toolkit reads version {FORMAT_VERSION}")
    return data


def verify_checkpoint(step_dir: Path) -> dict:
    """Check every file against manifest.json (size, then sha256); returns the manifest or raises UserError."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise UserError(f"{step_dir}: no such checkpoint directory")
    manifest = read_checkpoint_json(step_dir / MANIFEST_FILE, "the checkpoint's manifest; the save did not complete")
    _check_manifest(step_dir / MANIFEST_FILE, manifest)
    for name, entry in manifest["files"].items():
        path = step_dir / name
        if not path.is_file():
            raise UserError(f"{path}: missing from the checkpoint")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise UserError(f"{path}: truncated or altered: {size} bytes, manifest.json says {entry['bytes']}")
        if sha256_file(path) != entry["sha256"]:
            raise UserError(f"{path}: checksum mismatch: the file is corrupt (sha256 differs from manifest.json)")
    return manifest


# ---------------------------------------------------------------------------
# Finding and pruning checkpoints

def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete step directories (with a manifest), oldest first; `.tmp-*` leftovers of a crash are ignored."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = []
    for entry in ckpt_dir.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete step directory, or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1][1] if found else None


def recorded_checkpoint_dirname(run_dir: Path, default: str) -> str:
    """checkpoint.dir from a run directory's recipe.json, else `default`."""
    try:
        return json.loads((run_dir / "recipe.json").read_text())["checkpoint"]["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return default


def find_checkpoint(path: Path, checkpoint_dirname: str = "checkpoints") -> Path:
    """A step dir, a checkpoints dir (its newest) or a run dir (its newest) -> a step dir; UserError if none."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise UserError(f"{path}: not a directory; expected a run dir, a checkpoints dir or a step-NNNNNN dir")
    if STEP_DIR.match(path.name) or (path / MANIFEST_FILE).exists():
        return path
    inside = path / recorded_checkpoint_dirname(path, checkpoint_dirname)
    for candidate in (path, inside):
        latest = latest_checkpoint(candidate)
        if latest is not None:
            return latest
    raise UserError(f"{path}: no complete checkpoint (no step-NNNNNN directory with a manifest.json "
                    f"in {path} or {inside})")


def prune_checkpoints(ckpt_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and leftovers of crashed saves."""
    removed = []
    for _, path in list_checkpoints(ckpt_dir)[:-keep_last]:
        remove_dir(path)
        removed.append(path)
    for entry in Path(ckpt_dir).iterdir():
        if entry.name.startswith(TEMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    return removed
