"""The measured answers of `toolkit tune` (benchmarks/tune_grid/*.tune.json, the tuner's own trial files) against the
full grid measured for the same recipe on the same kind of card (benchmarks/tune_grid/*.jsonl): issue 31 holds the
tuner to a recipe at least as fast as the one written and at least 97% of the grid's best. Also: every trial the
tuner ran was predicted within the memory model's +-10%."""
import json
from pathlib import Path

import pytest

GRIDS = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_grid"
TUNES = sorted(GRIDS.glob("*.tune.json"))


def grid_speeds(tune_file: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in tune_file.with_name(tune_file.name.replace(".tune.json", ".jsonl"))
            .read_text().splitlines()]
    return {r["label"]: r["tokens_per_s"] for r in rows if r["tokens_per_s"]}


def test_every_tuner_answer_has_its_grid():
    assert len(TUNES) >= 3
    for tune_file in TUNES:
        assert grid_speeds(tune_file), tune_file.name


@pytest.mark.parametrize("tune_file", TUNES, ids=lambda p: p.name)
def test_the_answer_is_at_least_the_baseline_and_97_percent_of_the_grids_best(tune_file):
    tune = json.loads(tune_file.read_text())
    speeds = grid_speeds(tune_file)
    baseline = next(t["config"] for t in tune["trials"] if t["baseline"])
    answer = tune["decision"]["candidate"] if tune["decision"]["change"] else baseline
    assert speeds[answer] >= speeds[baseline]
    assert speeds[answer] >= 0.97 * max(speeds.values()), (answer, speeds[answer], max(speeds.values()))
    assert tune["elapsed_s"] <= tune["budget_s"]


@pytest.mark.parametrize("tune_file", TUNES, ids=lambda p: p.name)
def test_every_trial_that_ran_was_predicted_within_ten_percent(tune_file):
    ran = [t for t in json.loads(tune_file.read_text())["trials"] if t["status"] in ("ok", "rerun")]
    assert ran
    for t in ran:
        assert 0.9 <= t["predicted_gib"] / t["measured_peak_gib"] <= 1.1, t
