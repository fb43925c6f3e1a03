"""End-to-end training: the quickstart's golden losses through the real CLI, the
run-directory contract, and gradient accumulation against one big micro batch."""
import json
import math

import pytest
import torch

from tests.conftest import REPO, run_cli
from toolkit.data.batches import BatchStream, Dataset
from toolkit.checkpoint.checkpointer import Checkpointer
from toolkit.runtime.engine import Engine
from toolkit.errors import UserError
from toolkit.recipe.load import load_recipe

GOLDEN = REPO / "tests" / "golden" / "quickstart_losses.json"
# NOTE: the same CPU kind gives bit-identical losses; another CPU (other SIMD width)
# may sum in another order, and 200 steps amplify that slightly: 2e-3 absolute allows it
# while any real change to the maths (init, data, optimizer, schedule) moves losses by far more.
GOLDEN_ATOL = 2e-3


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("quickstart")
    proc = run_cli("run", "recipes/quickstart.json", "--run-dir", str(run_dir), "training.log_interval=1")
    assert proc.returncode == 0, proc.stderr
    return run_dir, proc


def test_quickstart_reproduces_golden_losses(quickstart_run):
    run_dir, _ = quickstart_run
    losses = {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m}
    golden = json.loads(GOLDEN.read_text())
    assert len(losses) == 200
    for step, expected in golden["losses"].items():
        assert losses[int(step)] == pytest.approx(expected, abs=GOLDEN_ATOL), f"step {step}"


def test_quickstart_loss_falls_toward_the_chain_entropy(quickstart_run):
    run_dir, proc = quickstart_run
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval_loss" in m]
    assert train[0]["loss"] > 0.9 * math.log(256)       # starts near ln(vocab)
    assert evals[-1]["eval_loss"] < 0.4 * train[0]["loss"]  # and learns the chain
    assert evals[-1]["eval_loss"] > math.log(4) - 0.05       # but never below its entropy
    assert "done: 200 steps" in proc.stdout


def test_run_directory_contract(quickstart_run):
    run_dir, _ = quickstart_run
    resolved = json.loads((run_dir / "recipe.json").read_text())
    assert resolved["recipe_hash"] == load_recipe("quickstart", ["training.log_interval=1"]).hash
    assert resolved["optimizer"]["eps"] == 1e-8  # defaults are filled in
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    for m in metrics:
        if "loss" in m:
            assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= m.keys()
            assert all(math.isfinite(m[k]) for k in ("loss", "lr", "grad_norm", "tokens_per_s"))
    assert [m["step"] for m in metrics if "eval_loss" in m] == [50, 100, 150, 200]


def _accumulate_then_train(overrides, steps=4):
    recipe = load_recipe("quickstart", ["data.num_samples=256", "training.max_steps=4", "scheduler.type=constant",
                                        *overrides])
    engine = Engine(recipe)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)
    micro_batches = stream.next_step()
    for micro_batch in micro_batches:   # the first step by hand, to look at the accumulated gradient
        engine.backward(engine(micro_batch))
    grads = [p.grad.detach().clone() for p in engine.model.parameters()]
    losses = [engine.step().loss]
    losses += [engine.train_batch(stream.next_step()).loss for _ in range(steps - 1)]
    return grads, losses, [p.detach().clone() for p in engine.model.parameters()]


def test_grad_accumulation_micro4_x2_matches_micro8_x1():
    grads_a, losses_a, params_a = _accumulate_then_train(["batch.micro_batch_per_rank=4", "batch.grad_accum_steps=2"])
    grads_b, losses_b, params_b = _accumulate_then_train(["batch.micro_batch_per_rank=8", "batch.grad_accum_steps=1"])
    # Two half batches vs one batch differ only in fp32 summation order.
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert losses_a == pytest.approx(losses_b, rel=1e-5)
    # NOTE: Adam divides by sqrt(v), so for a near-zero gradient that rounding noise can move
    # an update by a visible fraction of lr (3e-3 here); 2e-5 is under 1% of one step.
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)


def test_user_mistake_at_run_time_exits_2_without_traceback(tmp_path):
    proc = run_cli("run", "quickstart", "--run-dir", str(tmp_path), "training.device=cuda")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert proc.returncode == 2
    assert "recipe.training.device" in proc.stderr and "Traceback" not in proc.stderr


def test_divergence_is_reported_at_the_first_bad_step_and_blocks_checkpoints(tmp_path):
    # The engine keeps the divergence check on the device (a step never waits for the GPU);
    # reading a loss or saving a checkpoint raises it, naming the first step whose loss was not finite.
    recipe = load_recipe("quickstart", ["data.num_samples=256", "training.max_steps=4", "scheduler.type=constant"])
    engine = Engine(recipe)
    stream = BatchStream(Dataset(recipe.data).train, recipe.batch, rank=0, seed=recipe.training.seed)
    first = engine.train_batch(stream.next_step())
    assert math.isfinite(first.loss)
    with torch.no_grad():
        next(engine.model.parameters()).fill_(float("nan"))
    second, third = (engine.train_batch(stream.next_step()) for _ in range(2))
    assert math.isnan(float(third.loss_tensor))  # the value itself is readable without the check
    for result in (third, second):
        with pytest.raises(UserError, match=r"training diverged at step 2: the loss is not finite"):
            result.loss
    checkpointer = Checkpointer(recipe, tmp_path, engine, stream)
    with pytest.raises(UserError, match="diverged at step 2"):
        checkpointer.save()
    assert not any(tmp_path.rglob("*.safetensors"))
