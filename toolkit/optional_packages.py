"""Optional packages: the one table of what a base install of the toolkit leaves out,
which recipe key (or command) needs each, and the extra (pyproject.toml) that
installs it. `toolkit validate` and `toolkit run` check a recipe against it before
any work, the import sites call `require_package` first, and `toolkit doctor` lists it.

How to install an extra depends on how the toolkit was installed (`pip install "toolkit[extra]"`
would fetch an unrelated project of that name from the public index): from the checkout it runs
from (`pip install -e "/path/to/checkout[extra]"`), else from what pip recorded in the
distribution's direct_url.json (PEP 610: a local folder or archive, a VCS URL), else the extra's
requirements themselves.

Presence is asked with importlib.util.find_spec, which imports nothing (no torch,
no tensorboard): validate stays fast.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlparse

from toolkit.errors import UserError


# ---------------------------------------------------------------------------
# How this toolkit was installed, and so how to add an extra

DISTRIBUTION = "toolkit"


@dataclass(frozen=True)
class InstallOrigin:
    """How the running toolkit was installed: kind `checkout` (run from a source tree, or an editable install),
    `path` (a local folder or archive), `vcs` (a VCS URL), or `unknown`; `location` is its path or URL."""

    kind: str
    location: str = ""


def _is_toolkit_checkout(folder: Path) -> bool:
    pyproject = folder / "pyproject.toml"
    try:
        return pyproject.is_file() and re.search(r'(?m)^name\s*=\s*"toolkit"', pyproject.read_text()) is not None
    except (OSError, UnicodeDecodeError):
        return False


def _local_path(url: str) -> Path | None:
    parsed = urlparse(url)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" else None


def find_install_origin(package_dir: Path, direct_url: dict | None) -> InstallOrigin:
    """The origin of a toolkit package at `package_dir` whose distribution recorded `direct_url` (None: no record)."""
    checkout = package_dir.parent
    if _is_toolkit_checkout(checkout):  # PYTHONPATH, the current directory, or an editable install
        return InstallOrigin("checkout", str(checkout))
    url = (direct_url or {}).get("url", "")
    if "vcs_info" in (direct_url or {}):
        vcs = direct_url["vcs_info"]
        commit = vcs.get("commit_id") or vcs.get("requested_revision")
        return InstallOrigin("vcs", f"{vcs.get('vcs', 'git')}+{url}" + (f"@{commit}" if commit else ""))
    path = _local_path(url)
    if path is not None and path.exists():
        editable = (direct_url.get("dir_info") or {}).get("editable", False)
        return InstallOrigin("checkout" if editable else "path", str(path))
    return InstallOrigin("unknown")


@lru_cache(maxsize=1)
def install_origin() -> InstallOrigin:
    """The running toolkit's origin (read once)."""
    from importlib import metadata

    try:
        recorded = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
        direct_url = json.loads(recorded) if recorded else None
    except (metadata.PackageNotFoundError, ValueError, OSError):
        direct_url = None
    return find_install_origin(Path(__file__).resolve().parent, direct_url)  # this file is toolkit/'s


def _quoted(text: str) -> str:
    """Double quotes, as a shell reads them, unless the text holds a character they leave special."""
    if any(c in text for c in '"$`\\!'):
        import shlex

        return shlex.quote(text)
    return f'"{text}"'


def extra_requirements(extra: str) -> list[str]:
    """The requirements the installed distribution lists for `extra` (empty when it has no metadata)."""
    from importlib import metadata

    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""\bextra\s*==\s*["']{re.escape(extra)}["']""")
    return [req.split(";")[0].strip() for req in requires if ";" in req and marker.search(req.split(";", 1)[1])]


def install_command(extra: str, origin: InstallOrigin | None = None) -> str:
    """The command that installs the extra `extra` of this toolkit, for how it was installed."""
    origin = origin or install_origin()
    if origin.kind == "checkout":
        return f"pip install -e {_quoted(f'{origin.location}[{extra}]')}"
    if origin.kind == "path":
        return f"pip install {_quoted(f'{origin.location}[{extra}]')}"
    if origin.kind == "vcs":
        return f"pip install {_quoted(f'{DISTRIBUTION}[{extra}] @ {origin.location}')}"
    requirements = extra_requirements(extra)
    # NOTE: never `pip install "toolkit[extra]"`: the public index's `toolkit` is another project
    note = "install the toolkit from its source, not from the index, where 'toolkit' is another project"
    if not requirements:
        return f'pip install -e "/path/to/toolkit-source[{extra}]" ({note})'
    return (f"pip install {' '.join(_quoted(r) for r in requirements)} (the '{extra}' extra; for the extra "
            f"itself, {note})")


# ---------------------------------------------------------------------------
# The table

@dataclass(frozen=True)
class OptionalPackage:
    """One optional import: who needs it, and the extra that installs it."""

    module: str  # the top-level import name
    extra: str  # [project.optional-dependencies] in pyproject.toml
    needed_by: str  # a recipe key (`recipe.a.b`) or a command
    when: str  # the values of that key that need it, for `toolkit doctor` ("" for a command)
    wanted: Callable | None = None  # recipe -> bool: the recipe needs it; None: a command needs it
    required: bool = True  # False: a feature that is skipped with a note when the package is absent

    @property
    def install(self) -> str:
        """The command that installs this package's extra, for how this toolkit was installed."""
        return install_command(self.extra)

    def missing_line(self, recipe=None) -> str:
        """One line: what needs the package, that it is absent, and how to install it."""
        value = "" if recipe is None else _key_value(recipe, self.needed_by)
        return (f"{self.needed_by}{value}: needs the package '{self.module}', which is not installed; "
                f"{self.install}")


def _key_value(recipe, dotted: str) -> str:
    """` true`, ` 'offline'`: the recipe's value at `recipe.a.b` (resolved), for the message."""
    node = recipe.resolved
    for key in dotted.split(".")[1:]:
        node = node.get(key) if isinstance(node, dict) else None
    return "" if node is None else " " + ("true" if node is True else repr(node))


# NOTE: the one place that maps keys to packages to extras; tests check every extra
# named here exists in pyproject.toml and lists the package.
OPTIONAL_PACKAGES = (
    OptionalPackage("tensorboard", "dashboards", "recipe.logging.tensorboard", "true",
                    lambda r: r.logging.tensorboard),
    OptionalPackage("wandb", "dashboards", "recipe.logging.wandb.mode", "offline or online",
                    lambda r: r.logging.wandb.mode != "disabled"),
    OptionalPackage("pyarrow", "parquet", "recipe.data.kind", "parquet", lambda r: r.data.kind == "parquet"),
    # memory.png is drawn by every run: a base install skips it with a note, never fails.
    OptionalPackage("matplotlib", "dashboards", "memory.png", "(every run draws it; skipped with a note if absent)",
                    lambda r: True, required=False),
    OptionalPackage("jinja2", "tutorials", "toolkit tutorials build", ""),
    OptionalPackage("nbformat", "tutorials", "toolkit tutorials build", ""),
    OptionalPackage("nbclient", "tutorials", "toolkit tutorials build --execute", ""),
    OptionalPackage("ipykernel", "tutorials", "toolkit tutorials build --execute", ""),
)


def is_installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refusing the name, or a module with no spec
        return False


def package(module: str) -> OptionalPackage:
    """The table's entry for an import name."""
    return next(p for p in OPTIONAL_PACKAGES if p.module == module)


def missing_for_recipe(recipe) -> tuple[list[str], list[str]]:
    """(errors, notes): one line per package the recipe needs and this environment lacks."""
    errors, notes = [], []
    for pkg in OPTIONAL_PACKAGES:
        if pkg.wanted is not None and pkg.wanted(recipe) and not is_installed(pkg.module):
            if pkg.required:
                errors.append(pkg.missing_line(recipe))
            else:
                notes.append(f"{pkg.needed_by} will be skipped: '{pkg.module}' is not installed; {pkg.install}")
    return errors, notes


def check_recipe_packages(recipe) -> list[str]:
    """Raise UserError naming every package the recipe needs and lacks; returns the notes (optional features)."""
    errors, notes = missing_for_recipe(recipe)
    if errors:
        raise UserError(*errors)
    return notes


def check_command_packages(command: str) -> None:
    """Raise UserError naming every package a command (`toolkit tutorials build`) needs and lacks."""
    errors = [p.missing_line() for p in OPTIONAL_PACKAGES if p.needed_by == command and not is_installed(p.module)]
    if errors:
        raise UserError(*errors)


def require_package(module: str) -> None:
    """Raise the table's one line for `module` unless it is installed (call before importing it)."""
    if not is_installed(module):
        raise UserError(package(module).missing_line())


def doctor_lines() -> list[str]:
    """One line per optional package: installed (with its version) or how to install it, and who needs it."""
    from importlib.metadata import PackageNotFoundError, version

    lines = []
    for pkg in OPTIONAL_PACKAGES:
        if is_installed(pkg.module):
            try:
                state = f"{version(pkg.module)}"
            except PackageNotFoundError:
                state = "installed"
        else:
            state = f"missing ({pkg.install})"
        lines.append(f"{pkg.module:<12} {state}: needed by {pkg.needed_by}" + (f" {pkg.when}" if pkg.when else ""))
    return lines
