"""benchmarks/tune_grid.py measures every point it is given, the recipe as written first and marked, and its table
lists them fastest first as fractions of the best, naming what did not run and why."""
import json
import time

from benchmarks import tune_grid
from toolkit.train.tune_space import TuneSpace


def test_the_grid_runs_the_baseline_first_then_every_point_and_ranks_them(tmp_path):
    out = tmp_path / "grid.jsonl"
    space = TuneSpace(stages=(0,), micro_batches=(16,), offloads=("none",))
    rows = tune_grid.grid("quickstart", space, warmup=1, measure=1, deadline=time.monotonic() + 600, out=out,
                          log=lambda s: None)
    assert [r["baseline"] for r in rows] == [True, False]  # the recipe (stage 0, micro 16), then checkpointing
    assert rows[1]["changes"]["model.activation_checkpointing"] is True
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows  # written as each ended
    text = tune_grid.table(rows + [{**rows[1], "label": "stage 9", "status": "pruned", "why": "too big",
                                    "tokens_per_s": None}])
    speeds = [float(line.split("|")[2].replace(",", "")) for line in text.splitlines()[2:4]]
    assert speeds == sorted(speeds, reverse=True) and "| 1.000 |" in text.splitlines()[2]
    assert "**baseline**" in text and "stage 9 (pruned: too big)" in text


def test_past_the_deadline_no_point_starts(tmp_path):
    rows = tune_grid.grid("quickstart", TuneSpace(stages=(0,), micro_batches=(16,), offloads=("none",)), warmup=1,
                          measure=1, deadline=time.monotonic() - 1, out=None, log=lambda s: None)
    assert [r["status"] for r in rows] == ["not run", "not run"]
    assert tune_grid.table(rows) == "no point ran"


def test_a_skipped_point_is_listed_not_run_and_the_baseline_always_runs(tmp_path):
    rows = tune_grid.grid("quickstart", TuneSpace(stages=(0,), micro_batches=(16,), offloads=("none",)), warmup=1,
                          measure=1, deadline=time.monotonic() + 600, out=None, log=lambda s: None, skip="stage 0")
    assert [r["status"] for r in rows] == ["ok", "not run"] and "--skip stage 0" in rows[1]["why"]
