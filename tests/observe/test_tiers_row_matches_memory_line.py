"""The start-up table's `tiers` row and the end-of-run memory line print the same model-state bytes
per rank: on 2 gloo ranks, at ZeRO stages 0-3, with the optimizer offloaded to CPU memory at stages
1-3 and the parameters too at stage 3. (At stages 1-2 every rank holds the whole parameters; the row
once printed a rank's shard of them.)"""
import re

import pytest
import torch

from tests.conftest import become_rank, leave_rank
from tests.runtime.zero_helpers import fork_ranks

pytestmark = pytest.mark.dist

CONFIGS = {
    "stage0": ["zero.stage=0"],
    **{f"stage{s}": [f"zero.stage={s}"] for s in (1, 2, 3)},
    **{f"stage{s}-offload": [f"zero.stage={s}", "zero.offload_optimizer=cpu"] for s in (1, 2, 3)},
    "stage3-offload-params": ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"],
}
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _rank_main(rank, world, port, out_dir):
    become_rank(rank, world, port)
    from tests.runtime.zero_helpers import tiny_engine
    from toolkit.observe.memory_monitor import MemoryMonitor

    printed = {}
    for name, overrides in CONFIGS.items():
        _, engine, stream = tiny_engine(world, overrides)
        row = engine.strategy.describe_tiers()  # as the start-up table prints it, before the first step
        monitor = MemoryMonitor(engine)
        for step in range(2):
            engine.train_batch(stream.next_step())
            monitor.window_metrics(step)
        printed[name] = (row, monitor.summary())
    torch.save(printed, out_dir / f"rank{rank}.pt")
    leave_rank()


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """{config: (tiers row, memory summary)} of each of 2 ranks."""
    out_dir = tmp_path_factory.mktemp("tiers-row")
    fork_ranks(_rank_main, 2, out_dir)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def _row_bytes(row: str) -> dict[tuple[str, str], float]:
    """{(what, where): bytes} of a tiers row: `params device (463.0 KiB); fp32 grads device (...); ...`."""
    entries = re.findall(r"(params|grads|master\+moments|moments)(?: \(master: the params\))?(?: \d+%)? (device|CPU memory)s? "
                         r"\(([\d.]+ \w+)\)", row)
    assert entries, row
    found: dict[tuple[str, str], float] = {}
    for what, where, size in entries:
        found[what, where] = found.get((what, where), 0.0) + _bytes(size)
    return found


def _line_bytes(summary: str) -> dict[str, float]:
    """params, grads, optimizer + master and the offloaded bytes of the end-of-run memory line."""
    states = re.search(r"params ([\d.]+ \w+) \+ grads ([\d.]+ \w+) \+ optimizer ([\d.]+ \w+) \+ master ([\d.]+ \w+)",
                       summary)
    offloaded = re.search(r"offloaded to CPU memory per rank: ([\d.]+ \w+)", summary)
    params, grads, optim, master = (_bytes(size) for size in states.groups())
    return {"params": params, "grads": grads, "optimizer": optim + master,
            "offloaded": _bytes(offloaded.group(1)) if offloaded else 0.0}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.001 * max(a, b)  # each side is rounded to 4 significant digits


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", CONFIGS)
def test_tiers_row_and_memory_line_print_the_same_model_state_bytes(printed, name, rank):
    row, summary = printed[rank][name]
    got, line = _row_bytes(row), _line_bytes(summary)
    on_device = {what: size for (what, where), size in got.items() if where == "device"}
    in_cpu_memory = sum(size for (_, where), size in got.items() if where == "CPU memory")
    assert _close(on_device.get("params", 0.0), line["params"]), (row, summary)
    assert _close(on_device["grads"], line["grads"]), (row, summary)
    assert _close(in_cpu_memory, line["offloaded"]), (row, summary)
    if name != "stage0":  # NOTE: stage 0's torch AdamW makes its moments at the first step (the row says so)
        assert _close(on_device.get("master+moments", 0.0), line["optimizer"]), (row, summary)


def test_at_stages_1_and_2_each_rank_prints_the_whole_parameters(printed):
    whole = _row_bytes(printed[0]["stage0"][0])["params", "device"]
    for stage in (1, 2):
        assert _row_bytes(printed[0][f"stage{stage}"][0])["params", "device"] == whole
    assert _close(2 * _row_bytes(printed[0]["stage3"][0])["params", "device"], whole)  # stage 3: half each
