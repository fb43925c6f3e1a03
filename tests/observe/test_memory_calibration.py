"""The calibrated peak model against the committed measurements: every row of
benchmarks/memory_calibration/*.jsonl (real `toolkit run`s, measured by benchmarks/memory_calibration.py)
must stay within CALIBRATION_TOLERANCE of the prediction, so a change to the engine's memory or to
the model that breaks agreement fails here; on a GPU a few rows are measured again."""
import json
from pathlib import Path

import pytest

from toolkit.cuda_allocator import expandable_segments
from toolkit.observe.peak import (CALIBRATION_TOLERANCE, CPU_RSS_BAND, EXPANDABLE_RESERVED_TOLERANCE,
                                 RESERVED_TOLERANCE, compare_row)

ROOT = Path(__file__).resolve().parents[2]
TABLES = sorted((ROOT / "benchmarks" / "memory_calibration").glob("*.jsonl"))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


ROWS = [(path.stem, row) for path in TABLES for row in _rows(path) if row["status"] == "ok"]


def test_calibration_tables_cover_the_matrix():
    devices = {row["device"] for _, row in ROWS}
    assert any("H200" in d for d in devices) and any(d.startswith("cpu") for d in devices)
    gpu = [row for _, row in ROWS if "H200" in row["device"]]
    ids = " ".join(row["id"] for row in gpu)
    for axis in ("stage=0", "stage=1", "stage=2", "stage=3", "offload_optimizer=cpu", "offload_param=cpu", "ckpt",
                 "dtype=fp32", "dtype=fp16", "compile=true", "s1024", "s2048", "m1x", "m64x", "llama-3b",
                 "gpt2-1.5b", "size=250m", "size=774m"):
        assert axis in ids, f"no H200 row with {axis}"
    assert len(gpu) >= 30


@pytest.mark.parametrize("table,row", ROWS, ids=[f"{t}:{r['id']}" for t, r in ROWS])
def test_predicted_peak_within_tolerance_of_measured(table, row):
    c = compare_row(row)
    if row["device"].startswith("cpu"):  # the process's peak RSS: the prediction is a lower bound (peak.py)
        low, high = CPU_RSS_BAND
        assert low <= 1 / c["ratio"] <= high, f"{row['id']}: measured / predicted {1 / c['ratio']:.2f}"
        return
    assert abs(c["ratio"] - 1) <= CALIBRATION_TOLERANCE, (
        f"{row['id']}: predicted {c['predicted'] / 2**30:.2f} GiB, measured {c['measured'] / 2**30:.2f} GiB "
        f"({c['ratio']:.3f}); terms {c['prediction']}")
    if c["measured_reserved"]:
        reserved = c["predicted_reserved"] / c["measured_reserved"]
        tolerance = EXPANDABLE_RESERVED_TOLERANCE if expandable_segments(row.get("alloc_conf", "")) \
            else RESERVED_TOLERANCE
        assert abs(reserved - 1) <= tolerance, f"{row['id']}: reserved ratio {reserved:.3f}"


# Two rows measured again on a GPU: one per family, small enough for any 40 GB card.
REMEASURED = ("gpt2-124m m16x2 stage=1", "llama-1b m4x2 s1024 stage=1 dtype=fp16")


@pytest.mark.cuda
@pytest.mark.parametrize("row_id", REMEASURED)
def test_peak_measured_again_on_this_gpu_matches_prediction(row_id):
    from benchmarks.memory_calibration import run_config

    committed = next(row for _, row in ROWS if row["id"] == row_id and "H200" in row["device"])
    measured = run_config({k: committed[k] for k in ("id", "recipe", "overrides")}, committed["steps"])
    assert measured["status"] == "ok", measured.get("why")
    c = compare_row({**committed, **measured})
    assert abs(c["ratio"] - 1) <= CALIBRATION_TOLERANCE, (row_id, c["ratio"])
