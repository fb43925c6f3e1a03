"""`toolkit tune` on a CPU: a tiny recipe and a space whose best is unambiguous: micro batch 32 is pruned
by the memory estimate (the cap sits between its prediction and micro 4's), micro 1 needs four times the
micro steps of micro 4 for the same global batch, so micro 4 is clearly fastest. Trials are real
`toolkit run` processes; the tuned recipe extends the original with only the changed keys."""
import json

from tests.conftest import REPO
from toolkit.recipe.load import load_recipe
from toolkit.train.tune import TuneSpace, predict, tune
from toolkit.train.tune_report import write_outputs

TINY = {"model": {"family": "gpt2", "size": "tiny"},
        "data": {"kind": "synthetic", "seq_len": 16, "num_samples": 512, "eval_samples": 64},
        "batch": {"micro_batch_per_rank": 1, "global_batch": 32}, "training": {"max_steps": 100, "cpu_threads": 1}}
# NOTE: 16-token sequences and one thread: a micro step's fixed cost outweighs its compute, so micro 1 (32 micro
# steps) is several times slower than micro 4 (8), a gap no neighbour's load on a 2-core machine closes.


def test_tune_finds_the_known_best_and_writes_a_recipe_extending_the_original(tmp_path):
    recipe = tmp_path / "tiny.json"
    recipe.write_text(json.dumps(TINY))
    sizes = {m: predict(recipe, {"zero.stage": 0, "batch.micro_batch_per_rank": m, "batch.grad_accum_steps": 32 // m},
                        1, False)[0] for m in (4, 32)}
    cap = (sizes[4] + sizes[32]) // 2
    space = TuneSpace(stages=(0,), micro_batches=(1, 4, 32), checkpointing=(False,), offloads=("none",))
    result = tune(recipe, space=space, budget_s=120, cap_bytes=cap, warmup=1, measure=4, confirm=False,
                  log=lambda line: None)
    by_micro = {t.changes["batch.micro_batch_per_rank"]: t for t in result.trials}
    assert by_micro[32].status == "pruned" and "cap" in by_micro[32].why and by_micro[32].wall_s == 0
    assert by_micro[4].status == by_micro[1].status == "ok"
    assert by_micro[4].tokens_per_s > 1.5 * by_micro[1].tokens_per_s  # four times fewer micro steps
    assert result.best is by_micro[4] and by_micro[4].peak_bytes > 0
    written = write_outputs(result, tmp_path / "tuned.json")
    tuned = json.loads((tmp_path / "tuned.json").read_text())
    assert tuned["extends"] == "tiny.json" and tuned["batch"] == {"grad_accum_steps": 8, "micro_batch_per_rank": 4}
    assert set(tuned) == {"extends", "description", "batch"}  # only the changed keys
    assert load_recipe(tmp_path / "tuned.json").batch.global_batch == 32
    table = (tmp_path / "tuned.trials.md").read_text()
    assert "| 0 | stage 0, micro 32 | pruned |" in table and len(written) >= 3
