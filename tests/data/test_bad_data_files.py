"""Data files that are not what a corpus should be: globs through FIFOs, devices and
broken symbolic links, explicit paths to them, unreadable files, read errors, JSONL
nested too deeply, bad tokenizer folders and damaged cache entries. Each is one line
(a warning, or an error with exit code 2), never a traceback or a hang; through the
real CLI where a user meets it.
"""
from __future__ import annotations

import json
import os
import signal

import pytest

from tests.conftest import run_cli
from tests.text_corpus import python_like_docs, text_recipe, write_corpus
from toolkit.regular_files import open_regular_file
from toolkit.data.batches import Dataset
from toolkit.errors import UserError
from toolkit.recipe.load import recipe_from_dict
from toolkit.data.tokenizer import byte_tokenizer

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")


def write_recipe(tmp_path, data: dict | None = None) -> str:
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(text_recipe(tmp_path, data)))
    return str(path)


def one_error(proc) -> str:
    """The single error line of a refused command (exit 2, no traceback; `run` may warn about other things)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("warning: no peak FLOP/s")]
    assert len(lines) == 1, lines
    return lines[0]


@needs_fifo
def test_a_recursive_glob_skips_fifos_devices_and_broken_links_with_one_warning(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", python_like_docs(40))
    (corpus / "sub").mkdir()
    os.mkfifo(corpus / "sub" / "pipe.txt")               # reading it would block forever
    os.symlink("/dev/zero", corpus / "zero.txt")           # reading it would never end
    os.symlink("nowhere.txt", corpus / "dangling.txt")
    os.symlink("loop.txt", corpus / "loop.txt")
    recipe = write_recipe(tmp_path, {"paths": [str(corpus / "**" / "*.txt")]})
    for command in (["validate", recipe], ["run", recipe, "--run-dir", str(tmp_path / "run"),
                                            "training.max_steps=2"]):
        proc = run_cli(*command, timeout=120)
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if "skipped" in line]
        assert warnings == [f"warning: recipe.data.paths: skipped 4 match(es) that are not regular files, "
                            f"e.g. {corpus / 'dangling.txt'}: a dangling symbolic link (to nowhere.txt); "
                            "only regular files are read"], proc.stderr
    assert "text: 40 files" in proc.stdout


@needs_fifo
def test_a_plain_glob_skips_them_too_and_a_glob_of_nothing_else_is_an_error(tmp_path):
    (tmp_path / "corpus").mkdir()
    os.mkfifo(tmp_path / "corpus" / "pipe.txt")
    line = one_error(run_cli("validate", write_recipe(tmp_path)))
    assert line == (f"error: recipe.data.paths: no regular file to read: 1 match(es) that are not regular files, "
                    f"e.g. {tmp_path / 'corpus' / 'pipe.txt'}: not a regular file (a FIFO)")


@needs_fifo
@pytest.mark.parametrize("make, why", [
    (lambda p: os.mkfifo(p), "not a regular file (a FIFO)"),
    (lambda p: os.symlink("/dev/zero", p), "not a regular file (a character device)"),
    (lambda p: os.symlink(p, p), "a symbolic link that loops"),
])
def test_an_explicit_path_to_a_non_regular_file_is_an_error_naming_it(tmp_path, make, why):
    target = tmp_path / "data.txt"
    make(target)
    line = one_error(run_cli("validate", write_recipe(tmp_path, {"paths": [str(target)]})))
    assert line == f"error: recipe.data.paths[0]: {target}: {why}"


@needs_fifo
def test_a_fifo_swapped_in_after_listing_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")

    def blocked(*_):
        raise TimeoutError("open_regular_file blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, blocked)  # a regression fails here instead of hanging the suite
    signal.alarm(20)
    try:
        with pytest.raises(UserError, match=r"pipe.txt: not a regular file \(a FIFO\); only regular files are read"):
            open_regular_file(tmp_path / "pipe.txt")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file whatever its mode")
def test_an_unreadable_file_is_an_error_naming_it(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", python_like_docs(10))
    (corpus / "doc003.txt").chmod(0)
    line = one_error(run_cli("validate", write_recipe(tmp_path)))
    assert line == f"error: recipe.data.paths[0]: {corpus / 'doc003.txt'}: cannot read: permission denied"


def test_a_file_this_process_may_not_read_is_an_error_even_when_root_could(tmp_path, monkeypatch):
    # The same check as above, where chmod cannot deny (tests run as root): os.access answers for the process.
    import toolkit.data.paths as paths

    write_corpus(tmp_path / "corpus", python_like_docs(3))
    denied = str(tmp_path / "corpus" / "doc001.txt")
    monkeypatch.setattr(paths.os, "access", lambda path, mode: str(path) != denied)
    with pytest.raises(UserError) as info:
        paths.list_files((str(tmp_path / "corpus" / "*.txt"),), ())
    assert info.value.lines == [f"recipe.data.paths[0]: {denied}: cannot read: permission denied"]


@pytest.mark.skipif(not os.path.isfile("/proc/self/mem"), reason="needs Linux /proc")
def test_a_read_error_is_one_line_naming_the_file(tmp_path):
    # /proc/self/mem is a regular file that fails at offset 0 with EIO, even for root.
    recipe = write_recipe(tmp_path, {"paths": ["/proc/self/mem"]})
    line = one_error(run_cli("run", recipe, "--run-dir", str(tmp_path / "run"), "training.max_steps=2"))
    assert line == "error: /proc/self/mem: cannot read: Input/output error"


# NOTE: short ids: a 200,000-character id would reach the CLI's subprocess through PYTEST_CURRENT_TEST, over
# Linux's 128 KiB limit for one environment string (execve fails with "Argument list too long")
@pytest.mark.parametrize("content, problem", [
    pytest.param("[" * 100_000 + "]" * 100_000, "nested too deeply", id="arrays-100000-deep"),
    pytest.param('{"text": "x", "meta": ' + "{\"a\": " * 5000 + "1" + "}" * 5000 + "}", "nested too deeply",
                 id="objects-5000-deep"),
    pytest.param("", "EMPTY", id="empty"),
])
def test_jsonl_nested_too_deeply_or_empty_is_one_line(tmp_path, content, problem):
    path = tmp_path / "corpus" / "a.jsonl"
    path.parent.mkdir()
    path.write_text('{"text": "a first document"}\n' + content + "\n" if content else "")
    recipe = write_recipe(tmp_path, {"kind": "jsonl", "paths": [str(path)]})
    line = one_error(run_cli("run", recipe, "--run-dir", str(tmp_path / "run"), "training.max_steps=2"))
    if problem == "EMPTY":
        assert line == "error: recipe.data.paths: the 1 file(s) hold no text (empty corpus)"
    else:
        assert line.startswith(f"error: {path}:2: nested too deeply")


@pytest.mark.parametrize("damage, words", [
    (lambda tok: (tok / "tokenizer.json").write_bytes(os.urandom(200) + b"\xff"), "tokenizer.json: not UTF-8"),
    (lambda tok: (tok / "tokenizer.json").write_text('{"model": '), "tokenizer.json: cannot load:"),
    (lambda tok: (tok / "tokenizer_config.json").write_text("[1, 2]"), "expected a JSON object, got list"),
    (lambda tok: (tok / "tokenizer_config.json").write_text("[" * 100_000), "malformed JSON: nested too deeply"),
    (lambda tok: (tok / "tokenizer_config.json").write_text('{"eos_token": 5}'), "eos_token is 5, expected"),
    (lambda tok: (tok / "tokenizer_config.json").write_text('{"toolkit_kind": []}'), "toolkit_kind is [], expected"),
])
def test_a_bad_pretrained_tokenizer_folder_is_one_line_naming_the_file(tmp_path, damage, words):
    write_corpus(tmp_path / "corpus", python_like_docs(10))
    byte_tokenizer().save(tmp_path / "tok")
    damage(tmp_path / "tok")
    recipe = write_recipe(tmp_path, {"tokenizer": "pretrained", "tokenizer_path": str(tmp_path / "tok")})
    line = one_error(run_cli("validate", recipe))
    assert line.startswith(f"error: recipe.data.tokenizer_path: {tmp_path / 'tok'}/") and words in line, line


def test_a_damaged_token_cache_entry_is_rebuilt_with_a_warning(tmp_path, capsys):
    write_corpus(tmp_path / "corpus", python_like_docs(40))
    spec = recipe_from_dict(text_recipe(tmp_path, {"tokenizer": "bpe", "vocab_size": 300})).data
    first = Dataset(spec)
    tokens = first.corpus.train.tolist()
    with open(first.corpus.dir / "train.bin", "r+b") as f:  # cut short, as a full disk or a copy could leave it
        f.truncate(10)
    bpe = next(first.corpus.dir.parent.glob("bpe-*"))
    (bpe / "tokenizer.json").write_text("{")
    capsys.readouterr()
    again = Dataset(spec)
    err = capsys.readouterr().err
    assert f"warning: {bpe}: damaged cache entry (recipe.data.cache_dir: {bpe / 'tokenizer.json'}: cannot load" in err
    assert again.corpus.built and again.corpus.train.tolist() == tokens
    assert sorted(p.name for p in again.corpus.dir.parent.iterdir() if not p.name.startswith(".lock")) == sorted(
        [bpe.name, again.corpus.dir.name])
