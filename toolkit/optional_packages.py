"""Optional packages: the one table of what a base `pip install toolkit` leaves out,
which recipe key (or command) needs each, and the extra (pyproject.toml) that
installs it. `toolkit validate` and `toolkit run` check a recipe against it before
any work, the import sites call `require_package` first, and `toolkit doctor` lists it.

Presence is asked with importlib.util.find_spec, which imports nothing (no torch,
no tensorboard): validate stays fast.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

from toolkit.errors import UserError


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
        return f'pip install "toolkit[{self.extra}]"'

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
