"""The files a recipe's `data` section names: the ${variables} a path may use, globs
(`**` recursive, hidden names skipped as glob does) minus `exclude`, in a stable order.

Only regular files are listed: a glob's matches that are FIFOs, devices, sockets,
dangling or looping symbolic links are skipped with one warning (reading /dev/zero
or a FIFO would never end), and an explicit path to one is an error naming it
(toolkit/regular_files.py says why a path is not a regular file).

No torch and no reading here: `toolkit validate` imports this module to check that
the files exist. The documents in the files are read by toolkit/data/corpus.py.
"""
from __future__ import annotations

import fnmatch
import glob
import os
import re
import sysconfig
from pathlib import Path

from toolkit.errors import UserError, warn_once
from toolkit.regular_files import regular_file_problem
from toolkit.resources import user_cache_dir

# The variables `${name}` a path in a recipe may use; the schema's descriptions and the
# README list the same names (tests/data/test_data_recipes.py checks that they agree).
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
        "cache": str(user_cache_dir()),
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
            skipped.append((path, problem.words))
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
        else:
            problem = regular_file_problem(pattern)
            if problem is not None and problem.kind == "directory":
                raise UserError(f"{here}: {pattern}: is a directory; name its files with a glob such as "
                                f"{os.path.join(pattern, '**', '*.txt')}")
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

