"""Crash safety: a process saving checkpoints is SIGKILLed at 50 random moments;
every time, `latest` names a complete checkpoint and the newest one loads."""
import multiprocessing
import os
import random
import signal
import time

import torch

from toolkit.checkpoint.files import LATEST_FILE, latest_checkpoint, prune_checkpoints, verify_checkpoint
from toolkit.checkpoint.io import load_checkpoint, save_checkpoint

KILLS = 50


def _state(step: int) -> dict:
    # ~4 MB, so a save takes long enough for kills to land inside it.
    return {"weights": torch.full((1 << 20,), float(step)), "step_copy": step}


def _save_forever(ckpt_dir, first_step):
    # NOTE: a forked child must not enter an OpenMP region the parent already used (it would
    # hang); with one thread torch runs its loops inline.
    torch.set_num_threads(1)
    step = first_step
    while True:
        save_checkpoint(ckpt_dir, step, _state(step), meta={})
        prune_checkpoints(ckpt_dir, keep_last=2)
        step += 1


def test_sigkill_during_saves_never_leaves_a_partial_latest(tmp_path):
    ckpt_dir = tmp_path / "checkpoints"
    save_checkpoint(ckpt_dir, 0, _state(0), meta={})
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    newest_seen = 0
    kills_mid_save = 0
    for _ in range(KILLS):
        leftovers_before = {p.name for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")}
        child = ctx.Process(target=_save_forever, args=(ckpt_dir, newest_seen + 1))
        child.start()
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        kills_mid_save += any(p.name.startswith(".tmp-") and p.name not in leftovers_before for p in ckpt_dir.iterdir())
        named = (ckpt_dir / LATEST_FILE).read_text().strip()
        verify_checkpoint(ckpt_dir / named)   # raises if `latest` names a partial checkpoint
        newest = latest_checkpoint(ckpt_dir)
        ckpt = load_checkpoint(newest)        # checksums verified on load
        step = ckpt.state["step_copy"]
        assert torch.equal(ckpt.state["weights"], torch.full((1 << 20,), float(step)))
        assert step >= newest_seen
        newest_seen = step
    assert newest_seen > 0  # some saves completed between kills
    assert kills_mid_save >= 5  # and many kills landed inside a save (its temp dir left behind)
