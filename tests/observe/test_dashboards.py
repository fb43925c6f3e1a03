"""Dashboards read what a run wrote: TensorBoard's EventAccumulator and a real
TensorBoard server (its HTTP API) see every scalar of metrics.jsonl; W&B offline
writes a run under <run_dir>/wandb holding our metrics, and a resumed tracker
continues the same run id. No network: the server binds 127.0.0.1, W&B is offline."""
import json
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import free_port
from toolkit.recipe.load import load_recipe
from toolkit.observe.trackers import WandbTracker
from toolkit.train.loop import run

TINY = ["training.max_steps=6", "data.num_samples=256", "scheduler.type=constant", "training.log_interval=2",
        "logging.tensorboard=true", "logging.wandb.mode=offline"]
SERVER_DEADLINE_S = 60  # TensorBoard starts in ~2 s on an idle laptop; a loaded CI box needs more


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("dashboards")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        run(load_recipe("quickstart", TINY), run_dir, quiet=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, metrics


def scalars_by_tag(metrics: list[dict]) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every numeric field of metrics.jsonl, as the trackers log them."""
    out: dict[str, dict[int, float]] = {}
    for m in metrics:
        for key, value in m.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(key, {})[m["step"]] = value
    return out


# ---------------------------------------------------------------------------
# TensorBoard

def test_event_accumulator_sees_every_scalar_with_its_values(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, metrics = logged_run
    expected = scalars_by_tag(metrics)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "eval_loss", "mem_params_bytes", "mem_peak_bytes",
            "rss_bytes"} <= expected.keys()
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    assert set(events.Tags()["scalars"]) == expected.keys()
    for tag, by_step in expected.items():
        seen = {e.step: e.value for e in events.Scalars(tag)}
        assert seen.keys() == by_step.keys(), tag
        for step, value in by_step.items():  # event files store float32
            assert seen[step] == pytest.approx(value, rel=1e-6), (tag, step)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def test_tensorboard_server_serves_our_scalar_tags(logged_run):
    run_dir, metrics = logged_run
    expected = scalars_by_tag(metrics)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(run_dir / "tensorboard"), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    tags: dict = {}
    try:
        deadline = time.monotonic() + SERVER_DEADLINE_S
        while time.monotonic() < deadline and server.poll() is None:
            try:
                tags = get_json(f"{base}/data/plugin/scalars/tags").get(".", {})
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            if tags.keys() >= expected.keys():
                break
            time.sleep(0.25)
        assert set(tags) == expected.keys(), f"tags after {SERVER_DEADLINE_S}s; server exit code {server.poll()}"
        # one series through the API too: [wall_time, step, value] rows
        rows = get_json(f"{base}/data/plugin/scalars/scalars?run=.&tag=loss")
        assert [(step, pytest.approx(value, rel=1e-6)) for _, step, value in rows] == sorted(expected["loss"].items())
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        server.stdout.close()


# ---------------------------------------------------------------------------
# W&B (offline)

def wandb_records(path):
    """The protobuf records of a .wandb file (LevelDB log format: 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, offset, pieces = 32768, 7, []  # the file header is 7 bytes
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        pieces.append(data[offset + 7:offset + 7 + length])
        offset += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def wandb_history(run_dir) -> dict[str, dict[int, float]]:
    """{key: {step: value}} logged to every offline W&B run under run_dir/wandb."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                for key, value in row.items():
                    if not key.startswith("_"):
                        out.setdefault(key, {})[row["_step"]] = value
    return out


def settled_wandb_history(run_dir, timeout_s: float = 30) -> dict[str, dict[int, float]]:
    """wandb_history once every session under run_dir has written its exit record (bounded wait)."""
    # NOTE: W&B's service process may still be writing a session's file when finish() returns
    # (seen for a resumed session: header only, complete about a second later).
    def settled():
        files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        return files and all(f.stat().st_size >= 7 and any(r.WhichOneof("record_type") == "exit"
                                                           for r in wandb_records(f)) for f in files)

    deadline = time.monotonic() + timeout_s
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.2)
    return wandb_history(run_dir)


def test_wandb_offline_run_directory_holds_our_metrics(logged_run):
    run_dir, metrics = logged_run
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_id = runs[0].name.rsplit("-", 1)[1]
    assert (runs[0] / f"run-{run_id}.wandb").is_file()
    expected = scalars_by_tag(metrics)
    history = settled_wandb_history(run_dir)
    assert history.keys() == expected.keys()
    for key, by_step in expected.items():
        assert history[key] == pytest.approx(by_step, rel=1e-12), key


def test_wandb_tracker_resumed_with_the_stored_run_id_continues_the_same_run(tmp_path):
    # What a resume does with the run id a checkpoint stored (toolkit/checkpoint/checkpointer.py meta).
    first = WandbTracker(tmp_path, "toolkit", "resume-test", "offline", None, {"lr": 1e-3})
    first.log({"step": 1, "loss": 2.5})
    first.close()
    second = WandbTracker(tmp_path, "toolkit", "resume-test", "offline", first.run_id, {"lr": 1e-3})
    second.log({"step": 2, "loss": 2.0})
    second.close()
    assert second.run_id == first.run_id
    sessions = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2 and all(p.name.split("-")[3] == first.run_id for p in sessions)
    assert settled_wandb_history(tmp_path)["loss"] == {1: 2.5, 2: 2.0}
    run_records = [record.run for path in tmp_path.glob("wandb/offline-run-*/run-*.wandb")
                   for record in wandb_records(path) if record.WhichOneof("record_type") == "run"]
    assert [r.run_id for r in run_records] == [first.run_id] * 2


def test_console_progress_line_shows_mfu_only_when_known():
    import io

    from toolkit.observe.trackers import ConsoleTracker

    stream = io.StringIO()
    console = ConsoleTracker(total_steps=10, stream=stream)
    base = {"step": 5, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 5e4}
    console.log(base)
    console.log({**base, "mfu": 0.4123})
    first, second = stream.getvalue().splitlines()
    assert "MFU" not in first
    assert second.endswith("| MFU 41.2%")
