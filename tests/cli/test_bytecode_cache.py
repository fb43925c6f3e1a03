"""toolkit/cli/bytecode_cache.py: where the environment keeps no bytecode (PYTHONDONTWRITEBYTECODE and packages
installed without .pyc), the CLI sends it to the toolkit's own folder, so that only the first run compiles; where
the packages keep .pyc beside their sources, or the user chose otherwise, nothing changes."""
import importlib
import os
import py_compile
import subprocess
import sys

import pytest

from toolkit.cli import bytecode_cache


@pytest.fixture
def no_bytecode(monkeypatch, tmp_path):
    """A Python that may not write bytecode, a package without .pyc (`bare`) and one with (`compiled`)."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(bytecode_cache, "_used", None)
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "")  # restored at the end, whatever the code sets
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    for name in ("bare", "compiled"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "__init__.py").write_text("VALUE = 1\n")
    py_compile.compile(str(tmp_path / "src" / "compiled" / "__init__.py"))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    importlib.invalidate_caches()
    monkeypatch.setenv(bytecode_cache.ENV, str(tmp_path / "cache"))
    return tmp_path


def test_without_bytecode_the_folder_gets_it_and_doctor_says_where(no_bytecode):
    assert bytecode_cache.keeps_no_bytecode("bare") and not bytecode_cache.keeps_no_bytecode("compiled")
    folder = bytecode_cache.use_bytecode_cache("bare")
    assert folder == no_bytecode / "cache" and sys.pycache_prefix == str(folder) and not sys.dont_write_bytecode
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(folder)  # for the ranks and trials this process starts
    import bare  # noqa: F401  (imported for the .pyc it leaves)

    assert list(folder.rglob("__init__*.pyc")) and not (no_bytecode / "src" / "bare" / "__pycache__").exists()
    assert bytecode_cache.bytecode_lines("bare") == [
        f"python bytecode: kept in {folder} (this environment keeps none beside the packages; "
        "TOOLKIT_BYTECODE_CACHE=off turns that off)"]


def test_a_child_that_inherits_the_folder_writes_there_too(no_bytecode, monkeypatch):
    """A rank or a trial: PYTHONPYCACHEPREFIX from its parent, so Python set the prefix but writes nothing."""
    monkeypatch.setattr(sys, "pycache_prefix", str(no_bytecode / "cache"))
    assert bytecode_cache.use_bytecode_cache("compiled") == no_bytecode / "cache" and not sys.dont_write_bytecode


@pytest.mark.parametrize("case", ["pyc beside the sources", "off", "an explicit prefix", "python writes anyway",
                                  "folder not writable"])
def test_otherwise_nothing_changes(no_bytecode, monkeypatch, case):
    probe = "compiled" if case == "pyc beside the sources" else "bare"
    if case == "off":
        monkeypatch.setenv(bytecode_cache.ENV, "off")
    elif case == "an explicit prefix":
        monkeypatch.setattr(sys, "pycache_prefix", str(no_bytecode / "theirs"))
    elif case == "python writes anyway":
        monkeypatch.setattr(sys, "dont_write_bytecode", False)
    elif case == "folder not writable":
        (no_bytecode / "file").write_text("")
        monkeypatch.setenv(bytecode_cache.ENV, str(no_bytecode / "file" / "cache"))
    before = (sys.pycache_prefix, sys.dont_write_bytecode)
    assert bytecode_cache.use_bytecode_cache(probe) is None
    assert (sys.pycache_prefix, sys.dont_write_bytecode) == before
    lines = bytecode_cache.bytecode_lines(probe)
    if case in ("off", "folder not writable"):  # still slow: doctor says so, and why
        assert lines and "keeps no bytecode" in lines[0] and ("=off" in lines[0]) == (case == "off")
    else:
        assert lines == []


def test_the_command_sets_it_before_anything_else(tmp_path):
    """`toolkit` itself calls it first (probed as if torch kept no .pyc), in a process of its own."""
    script = ("import sys; from toolkit.cli import bytecode_cache as b; b.keeps_no_bytecode = lambda probe='torch': "
              "True; from toolkit.cli.main import main; code = main(['validate', 'quickstart']); "
              "print(sys.pycache_prefix, sys.dont_write_bytecode, code)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TOOLKIT_BYTECODE_CACHE": str(tmp_path / "c")})
    assert out.stdout.split()[-3:] == [str(tmp_path / "c"), "False", "0"], out.stdout + out.stderr
