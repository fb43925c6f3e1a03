"""The notes a `toolkit run --nproc` rank leaves for its launcher (toolkit/train/launch.py end_rank): a stopped
run's line from every rank, so it survives one rank ending otherwise; a lost peer leaves none."""
import signal

from toolkit.train.launch import _read_notes, end_rank
from toolkit.train.stop import EXIT_PEER_LOST, NOTES_ENV, RunStopped


def _stopped(tmp_path):
    return RunStopped(signal.SIGTERM, tmp_path / "run", 7, 100, tmp_path / "run/checkpoints/step-000007")


def test_every_rank_leaves_the_same_stop_line_and_the_launcher_reads_it(tmp_path, monkeypatch):
    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv(NOTES_ENV, str(notes))
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        assert end_rank(_stopped(tmp_path)) == 143
    line = _stopped(tmp_path).describe()
    assert line.startswith("stopped by SIGTERM at step 7 of 100: checkpoint ")
    assert _read_notes(notes) == {0: (143, [line]), 1: (143, [line])}


def test_a_rank_that_lost_its_peer_leaves_no_note(tmp_path, monkeypatch):
    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv(NOTES_ENV, str(notes))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert end_rank(RuntimeError("[pair.cc:537] Read error: Connection reset by peer")) == EXIT_PEER_LOST
    assert _read_notes(notes) == {}


def test_without_a_launcher_only_rank_0_prints_the_stop_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(NOTES_ENV, raising=False)
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        end_rank(_stopped(tmp_path))
    assert capsys.readouterr().err.splitlines() == [_stopped(tmp_path).describe()]


def test_a_stopped_rank_leaves_its_line_before_the_slow_teardown(tmp_path, monkeypatch):
    """The launcher kills ranks still tearing down when its shutdown timeout ends: the stop line is left as soon as
    the checkpoint is saved, before the trackers close, memory.png is drawn and the group is left."""
    import pytest

    from toolkit.observe.memory_monitor import MemoryMonitor
    from toolkit.recipe.load import load_recipe
    from toolkit.train import loop

    notes = tmp_path / "notes"
    notes.mkdir()
    monkeypatch.setenv(NOTES_ENV, str(notes))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(loop, "_loop", lambda run, stop, start: signal.SIGTERM)  # stopped at the first boundary
    seen = []
    monkeypatch.setattr(MemoryMonitor, "write_timeline", lambda self, path: seen.append(_read_notes(notes)) or "")
    recipe = load_recipe("quickstart", ["training.max_steps=2", "checkpoint.save_final=false"])
    with pytest.raises(RunStopped) as stopped:
        loop.run(recipe, run_dir=tmp_path / "run", quiet=True)
    assert seen == [{0: (143, [stopped.value.describe()])}]
