"""ZeRO-Infinity on the CPU: stage 3 with offload_param cpu / nvme and offload_optimizer nvme equals
stage 0 after 10 steps on gloo (2 ranks; the tolerance and its reason are tests/runtime/zero_helpers.py's),
parameters really come from their tier at every gather, checkpoints move between offload settings, the
swap folder goes at exit (also after an error), bad nvme_path values are one line each, and host
memory stays bounded with NVMe optimizer offload as the model grows (measured RSS)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import REPO, become_rank, free_port
from tests.runtime.zero_helpers import (RTOL, STEPS, assert_offload_param_changes_nothing, assert_params_close,
                                        tiny_engine, train)

STAGE3 = ["zero.stage=3", "zero.prefetch_units=1"]


def configs(swap: Path) -> dict[str, list[str]]:
    nvme = f"zero.nvme_path={swap}"
    return {"stage0": ["zero.stage=0"],
            "param-cpu": [*STAGE3, "zero.offload_param=cpu"],
            "param-nvme": [*STAGE3, "zero.offload_param=nvme", nvme],
            "optimizer-nvme": [*STAGE3, "zero.offload_optimizer=nvme", nvme],
            # the optimizer on three tiers: the root unit on the device, a block in CPU memory, a block swapped
            "optimizer-three-tiers": [*STAGE3, "zero.offload_optimizer=nvme", "zero.offload_ratio=0.7",
                                      "zero.nvme_ratio=0.5", nvme]}


def _rank_main(rank, world, port, out_dir):
    become_rank(rank, world, port)
    results = {}
    for name, overrides in configs(out_dir / "swap").items():
        engine, _, losses, norms = train(world, overrides)
        strategy = engine.strategy
        seen = {"losses": losses, "grad_norms": norms, "memory": strategy.memory_bytes(),
                "gathered": strategy.gathered_units() if strategy.stage == 3 else None}
        if getattr(strategy, "swap_dir", None) is not None:
            seen["swap_dir"], seen["swap_bytes"] = str(strategy.swap_dir.path), strategy.swap_dir.disk_bytes()
            seen["swap_files"] = sorted(p.name for p in strategy.swap_dir.path.iterdir())
        if strategy.stage == 3:
            seen["shard_numel"] = strategy.layout.numel
            seen["tiers"] = [(p.tier, p.layout.numel) for p in strategy.parts]
        seen["params"] = strategy.full_parameters()
        results[name] = seen
        if getattr(strategy, "swap_dir", None) is not None:  # NOTE: forked ranks skip atexit; a test below checks it
            strategy.swap_dir.remove()
    torch.save(results, out_dir / f"rank{rank}.pt")
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("infinity")
    (out / "swap").mkdir()
    _import_before_fork()
    mp.start_processes(_rank_main, args=(2, free_port(), out), nprocs=2, join=True, start_method="fork")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], out


def _import_before_fork():
    # NOTE: forked processes inherit the parent's imports (transformers, the engine): on a loaded 2-core machine
    # importing them costs several seconds per process, more than all the training here.
    from transformers import GPT2LMHeadModel  # noqa: F401
    import toolkit.runtime.engine  # noqa: F401


@pytest.mark.dist
@pytest.mark.parametrize("name", ["param-cpu", "param-nvme", "optimizer-nvme", "optimizer-three-tiers"])
def test_zero_infinity_matches_stage0_after_ten_steps_on_two_ranks(name, world2):
    ranks, _ = world2
    reference = ranks[0]["stage0"]
    for rank in ranks:
        got = rank[name]
        assert_params_close(got["params"], reference["params"])
        assert got["losses"] == pytest.approx(reference["losses"], rel=RTOL)
        assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=RTOL)
        assert got["gathered"] == 0  # nothing gathered between steps


@pytest.mark.dist
def test_offloaded_parameters_leave_the_device_and_swap_folders_go_at_exit(world2):
    ranks, out = world2
    for index, rank in enumerate(ranks):
        n = rank["param-cpu"]["shard_numel"]
        # fp32: the parameter shard lives in CPU memory (4n), the device holds no parameter between uses
        assert rank["param-cpu"]["memory"]["mem_params_bytes"] == 0
        assert rank["param-cpu"]["memory"]["mem_offload_bytes"] == 4 * n
        nvme = rank["param-nvme"]
        assert nvme["memory"]["mem_params_bytes"] == 0 and nvme["memory"]["mem_offload_bytes"] == 0
        assert nvme["swap_files"] == [f"params-rank{index}.bin"] and nvme["swap_bytes"] >= 4 * n
        opt = rank["optimizer-nvme"]
        assert opt["memory"]["mem_offload_bytes"] == 0 and opt["swap_bytes"] >= 12 * n  # master + moments
        assert Path(opt["swap_dir"]).parent == out / "swap"
    assert ranks[0]["optimizer-nvme"]["swap_dir"] != ranks[1]["optimizer-nvme"]["swap_dir"]  # one per process


@pytest.mark.dist
def test_nvme_ratio_splits_the_offloaded_optimizer_between_cpu_memory_and_swap_files(world2):
    ranks, _ = world2
    for index, rank in enumerate(ranks):
        three = rank["optimizer-three-tiers"]
        (_, device), (_, cpu), (_, nvme) = three["tiers"]
        assert [tier for tier, _ in three["tiers"]] == ["none", "cpu", "nvme"]
        assert device + cpu + nvme == three["shard_numel"]
        assert three["memory"]["mem_offload_bytes"] == 12 * cpu  # fp32 master + two moments in CPU memory
        assert three["memory"]["mem_optim_bytes"] == 8 * device
        assert three["swap_files"] == [f"optimizer-rank{index}-units2-3.bin"]
        assert 12 * nvme <= three["swap_bytes"] < 12 * nvme + 65536  # disk usage: whole file-system blocks


EXIT_SCRIPT = r"""
import sys
from toolkit.runtime.zero.swap import SwapDir
swap = SwapDir(sys.argv[1])
swap.file("optimizer-rank0.bin", 1 << 20).write(__import__("torch").ones(1024), 0)
print(swap.path, flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("training failed")
"""


@pytest.mark.parametrize("how", ["return", "raise"])
def test_swap_folder_goes_when_the_process_exits(how, tmp_path):
    """The process's folder under nvme_path is removed at exit, also when training raised."""
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), how], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == (1 if how == "raise" else 0), out.stderr[-2000:]
    made = Path(out.stdout.strip())
    assert made.parent == tmp_path and made.name.startswith("toolkit-swap-")
    assert list(tmp_path.iterdir()) == []


def test_swapped_parameters_are_read_from_the_file_at_every_gather(tmp_path):
    """Zeroing block 0's bytes in the swap file zeroes block 0's weights at the next gather."""
    _, engine, stream = tiny_engine(1, [*STAGE3, "zero.offload_param=nvme", f"zero.nvme_path={tmp_path}"])
    engine.train_batch(stream.next_step())
    strategy = engine.strategy
    weights = strategy.weights
    chunk = strategy.groups[0].chunk
    weights.file.write(torch.zeros(chunk, dtype=torch.float32), weights._offset(0))
    params = strategy.full_parameters()
    block0 = [s.name for s in strategy.groups[0].slots]
    assert block0 and all(float(params[n].abs().max()) == 0 for n in block0)
    assert any(float(params[s.name].abs().max()) > 0 for s in strategy.groups[1].slots)
    assert strategy.memory_bytes()["mem_params_bytes"] == 0
    strategy.swap_dir.remove()


def test_checkpoints_move_between_nvme_offload_and_none(tmp_path):
    """Saved without offload at step 5, resumed with both nvme tiers (the optimizer over three: device, CPU
    memory, swap file) and saved at step 7, resumed without: each resumed run's losses are the uninterrupted run's."""
    from toolkit.checkpoint.checkpointer import Checkpointer, restore_engine_and_stream
    from toolkit.checkpoint.files import find_checkpoint
    from toolkit.checkpoint.io import load_checkpoint

    plain = STAGE3
    nvme = [*STAGE3, "zero.offload_param=nvme", "zero.offload_optimizer=nvme", "zero.offload_ratio=0.7",
            "zero.nvme_ratio=0.5", f"zero.nvme_path={tmp_path}"]

    def run(overrides, resume_from, save_at, folder):
        recipe, engine, stream = tiny_engine(1, overrides)
        checkpointer = Checkpointer(recipe, tmp_path / folder, engine, stream)
        start = 0
        if resume_from is not None:
            ckpt = load_checkpoint(find_checkpoint(tmp_path / resume_from))
            restore_engine_and_stream(ckpt, engine, stream)
            start = ckpt.step
        losses = []
        for step in range(start, STEPS):
            losses.append(engine.train_batch(stream.next_step()).loss)
            if step + 1 == save_at:
                checkpointer.save()
        if engine.strategy.swap_dir is not None:
            engine.strategy.swap_dir.remove()
        return losses

    uninterrupted = run(plain, None, 5, "plain")
    assert run(nvme, "plain", 7, "nvme") == pytest.approx(uninterrupted[5:], rel=RTOL)
    assert run(plain, "nvme", None, "again") == pytest.approx(uninterrupted[7:], rel=RTOL)


@pytest.mark.parametrize("case", ["missing", "readonly", "full"])
def test_bad_nvme_path_is_one_line_before_training(case, tmp_path, monkeypatch):
    from toolkit.errors import UserError

    path = tmp_path / "swap"
    if case != "missing":
        path.mkdir()
    if case == "readonly":
        path.chmod(0o500)
        if os.geteuid() == 0:  # NOTE: root writes anywhere; stand in for a read-only mount
            monkeypatch.setattr("toolkit.runtime.zero.swap.os.access", lambda p, mode: False)
    if case == "full":
        monkeypatch.setattr("toolkit.runtime.zero.swap.shutil.disk_usage",
                            lambda p: type("Usage", (), {"free": 1000})())
    with pytest.raises(UserError) as raised:
        tiny_engine(1, [*STAGE3, "zero.offload_optimizer=nvme", f"zero.nvme_path={path}"])
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"recipe.zero.nvme_path: {path}: ")
    assert {"missing": "no such folder", "readonly": "not writable", "full": "GiB free"}[case] in message
    if case != "missing":
        assert list(path.iterdir()) == []


def _rss_main(swap: Path, out: Path, layers: tuple[int, ...]):
    """In a child process: peak RSS while training 2 steps at each depth, both tiers nvme, then both cpu."""
    import ctypes
    import gc
    import threading
    import time

    import toolkit.runtime.zero.offload as offload

    # NOTE: a fixed mmap threshold, so that freed tensors (the model as first built) go back to the
    # OS and RSS counts live memory, not glibc's heap (whose threshold otherwise grows to 32 MiB).
    ctypes.CDLL(None).mallopt(-3, 131072)  # M_MMAP_THRESHOLD
    torch.set_num_threads(1)
    offload.PIECE_NUMEL = 1 << 17  # NOTE: the step's buffers are 36 B x PIECE_NUMEL; keep them below the models

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    rows = []
    # NOTE: a first, unmeasured run loads what the first step imports lazily, which would count as growth
    for tier, depth in [("cpu", 1)] + [(t, n) for t in ("nvme", "cpu") for n in layers]:
        overrides = ["zero.stage=3", "model.n_embd=256", "model.n_head=4", f"model.n_layer={depth}",
                     "batch.global_batch=2", f"zero.offload_optimizer={tier}", f"zero.offload_param={tier}"]
        if tier == "nvme":
            overrides.append(f"zero.nvme_path={swap}")
        gc.collect()
        _, engine, stream = tiny_engine(1, overrides)
        peak, done = [rss()], []

        def sample():
            while not done:
                peak.append(rss())
                time.sleep(0.002)

        thread = threading.Thread(target=sample)
        thread.start()
        for _ in range(2):
            engine.train_batch(stream.next_step())
        done.append(1)
        thread.join()
        rows.append((tier, depth, engine.num_parameters, max(peak)))
        if engine.strategy.swap_dir is not None:
            engine.strategy.swap_dir.remove()
        del engine, stream
    torch.save(rows[1:], out)


@pytest.mark.slow
def test_host_memory_stays_bounded_with_nvme_offload_as_the_model_grows(tmp_path):
    """Peak RSS while training at 1 and 9 blocks: with both nvme tiers it grows by less than the 12 bytes
    per parameter of fp32 master + moments alone (the fp32 gradient shard stays: on a CPU run that is the
    device); with both cpu tiers, the control, by the 12 bytes of moments and parameters more (the parameters in
    CPU memory are the master there: shard_part.host_shard_as_master)."""
    (tmp_path / "swap").mkdir()
    # NOTE: a fresh interpreter (spawn), not a fork: this worker process has run other tests' threads and thread
    # pools by now, and a fork taken while one of them held a lock hung once in CI (exit code None after 300 s)
    process = mp.get_context("spawn").Process(target=_rss_main, args=(tmp_path / "swap", tmp_path / "rss.pt", (1, 9)))
    process.start()
    process.join(300)
    assert process.exitcode == 0
    seen = {(tier, depth): (params, peak) for tier, depth, params, peak in torch.load(tmp_path / "rss.pt")}
    growth = {tier: (seen[tier, 9][1] - seen[tier, 1][1]) / (seen[tier, 9][0] - seen[tier, 1][0])
              for tier in ("nvme", "cpu")}
    # NOTE: measured on 2 cores: nvme ~9.3, cpu ~21.3 bytes per parameter (25.7 while the master was a copy of the
    # parameter shard). Both include the fp32 gradient shard (4) and the activations, which grow with depth too:
    # 2.3 per parameter here (saved tensors, counted), held in glibc's heap after they are freed (each is under the
    # mmap threshold), so RSS keeps ~2 of them between steps with no live tensor behind them. The cpu tiers add
    # the moments (8) and the parameter shard, which is the master (4).
    assert growth["nvme"] < 12, growth
    assert growth["cpu"] - growth["nvme"] > 10, growth
    assert list((tmp_path / "swap").iterdir()) == []


def test_fp32_parameters_in_cpu_memory_are_the_offloaded_master_and_train_as_on_the_device(tmp_path):
    """offload_param cpu with offload_optimizer cpu under fp32: the host's fp32 parameter shard is the master (stepped
    in place, not copied beside it: 12 bytes an element of CPU memory, not 16), bit for bit as offload_param none."""
    strategy = assert_offload_param_changes_nothing(["zero.offload_optimizer=cpu"], tmp_path)["cpu"].strategy
    assert strategy.parts[-1].weights_are_master
    assert strategy.memory_bytes()["mem_offload_bytes"] == 12 * strategy.layout.numel


@pytest.mark.parametrize("param", ["none", "cpu"])
def test_stage_3_releases_each_units_full_buffer_before_the_gradient_shard_and_optimizer_exist(param, monkeypatch):
    """The device holds the whole model only while it is built: every unit's full buffer is released before the
    gradient shard and the optimizer's parts are allocated (on the H200 a 28.4B model's bf16 weights beside them ran
    out of memory)."""
    from toolkit.runtime.zero.stage3 import Stage3Strategy

    seen = []
    original = Stage3Strategy._init_master

    def init_master(self):
        seen.append([f.untyped_storage().size() for f in self.full])
        original(self)

    monkeypatch.setattr(Stage3Strategy, "_init_master", init_master)
    _, engine, stream = tiny_engine(1, ["zero.stage=3", f"zero.offload_param={param}"])
    assert len(seen) == 1 and len(seen[0]) == len(engine.strategy.full) > 1 and not any(seen[0])
    engine.train_batch(stream.next_step())  # and the units gather again when needed
