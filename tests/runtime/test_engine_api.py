"""The Python API as a DeepSpeed user meets it: `toolkit.initialize(recipe, model=m)` with any
nn.Module (forward returning a loss tensor, an output with .loss, or logits), under ZeRO stages,
bf16 and the memory monitor; `engine.save_checkpoint` / `engine.load_checkpoint` with client_state
(one process, and 2 gloo ranks saving for 1 loading); and the README's Python snippet, run as written."""
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import REPO, become_rank, leave_rank
from tests.runtime.zero_helpers import fork_ranks
from toolkit.runtime.engine import initialize
from toolkit.errors import UserError
from toolkit.recipe.load import recipe_from_dict

VOCAB, SEQ, MICRO = 64, 16, 4
BASE = {
    "model": {"family": "gpt2", "size": "tiny"},  # unused where a model is given
    "data": {"kind": "synthetic", "seq_len": SEQ, "vocab_size": VOCAB, "branching": 4, "num_samples": 64,
             "eval_samples": 8, "seed": 0},
    "batch": {"micro_batch_per_rank": MICRO, "grad_accum_steps": 1},
    "optimizer": {"lr": 0.01, "implementation": "torch"},
    "scheduler": {"type": "constant"},
    "training": {"max_steps": 10, "seed": 7, "eval_interval": 0},
    "logging": {"console": False, "tensorboard": False, "wandb": {"mode": "disabled"}},
}


class TinyLM(nn.Module):
    """Embedding, a mixing layer, a head: no ModuleList, so stage 3 makes each direct child a unit."""

    def __init__(self, returns: str = "logits", seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.mix, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.Linear(32, VOCAB)
        self.returns = returns

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.mix(self.embed(input_ids))))
        if self.returns == "logits":
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        if self.returns == "loss":
            return loss
        if self.returns == "output":
            return SimpleNamespace(loss=loss, logits=logits)
        return logits, loss  # a tuple: not something the engine can read


def token_batches(count: int, rows: int = MICRO, seed: int = 3) -> list[torch.Tensor]:
    """Learnable token ids: random starts, then each token a fixed function of the one before."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.empty(rows, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen)
        for t in range(SEQ):
            tokens[:, t + 1] = (tokens[:, t] * 5 + 3) % VOCAB
        batches.append(tokens)
    return batches


def as_batch(tokens: torch.Tensor, kind: str):
    """Token ids for a model returning logits; a dict with labels for one computing its own loss."""
    return tokens if kind == "logits" else {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def engine_for(kind: str = "logits", overrides=(), **kwargs):
    return initialize(recipe_from_dict(BASE, list(overrides)), model=TinyLM(kind), **kwargs)


def train(engine, kind: str, steps: int, seed: int = 3) -> list[float]:
    return [engine.train_batch([as_batch(t, kind)]).loss for t in token_batches(steps, seed=seed)]


# ---------------------------------------------------------------------------
# Your own model: the three kinds of forward output


@pytest.mark.parametrize("kind", ["loss", "output"])
def test_a_user_model_returning_its_loss_trains_exactly_like_one_returning_logits(kind):
    # Same weights, same batches: the engine's cross-entropy on logits and the model's own loss agree.
    reference = train(engine_for("logits"), "logits", 6)
    engine = engine_for(kind)
    got = train(engine, kind, 6)
    assert got == pytest.approx(reference, rel=1e-6)
    assert got[-1] < got[0] - 0.1  # it learns
    assert engine.global_step == 6


def test_the_engine_scores_logits_against_the_next_tokens_of_a_token_batch():
    engine = engine_for("logits")
    tokens = token_batches(1)[0]
    fresh = TinyLM("logits")
    want = F.cross_entropy(fresh(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).detach()
    assert float(engine(tokens).detach()) == pytest.approx(float(want), rel=1e-6)


def test_dict_labels_are_aligned_with_the_logits_and_minus_100_is_skipped():
    engine = engine_for("logits")
    tokens = token_batches(1)[0]
    labels = tokens[:, 1:].clone()
    labels[:, :8] = -100
    logits = TinyLM("logits")(tokens[:, :-1])
    want = F.cross_entropy(logits[:, 8:].flatten(0, 1), tokens[:, 9:].flatten()).detach()
    got = engine({"input_ids": tokens[:, :-1], "labels": labels})
    assert float(got.detach()) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize("kind, batch, message", [
    ("tuple", "dict", "TinyLM.forward returned a tuple; the engine expects a 0-dim loss tensor, an output with .loss"),
    ("logits", "dict-without-labels", "TinyLM.forward returned logits but the batch has no labels"),
    ("logits", "float", "batch: a tensor batch is token ids [micro_batch, seq_len + 1] (int64), got torch.float32"),
    ("logits", "short-labels", "batch labels [4, 8] do not match the logits [4, 16, 64]"),
])
def test_what_the_engine_cannot_read_is_one_user_error(kind, batch, message):
    engine = engine_for(kind)
    tokens = token_batches(1)[0]
    batches = {"dict": as_batch(tokens, "loss"), "dict-without-labels": {"input_ids": tokens[:, :-1]},
               "float": tokens.float(), "short-labels": {"input_ids": tokens[:, :-1], "labels": tokens[:, :8]}}
    with pytest.raises(UserError) as caught:
        engine(batches[batch])
    assert len(caught.value.lines) == 1 and message in caught.value.lines[0]


def test_backward_of_a_loss_without_gradient_is_a_user_error():
    engine = engine_for("logits")
    with pytest.raises(UserError, match="the loss does not depend on the model's parameters"):
        engine.backward(torch.tensor(1.0))


def test_a_user_model_trains_in_bf16_on_the_cpu_under_stage_3_with_its_children_as_units():
    engine = engine_for("loss", ["precision.dtype=bf16", "zero.stage=3"])
    assert [len(g.params) for g in engine.strategy.groups] == [1, 2, 2, 0]  # embed, mix, head; an empty root
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    fp32 = train(engine_for("loss"), "loss", 6)
    got = train(engine, "loss", 6)
    assert got == pytest.approx(fp32, rel=2e-2)  # bf16 weights track fp32 to bf16 precision
    assert got[-1] < got[0] - 0.1


def test_stage3_finds_units_by_the_documented_rule():
    from toolkit.runtime.zero.stage3 import find_units

    class Blocks(nn.Module):  # a transformer's shape: the largest ModuleList of one class
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
            self.norms = nn.ModuleList([nn.LayerNorm(4) for _ in range(3)])

    blocks = Blocks()
    assert find_units(blocks) == list(blocks.blocks)
    mixed = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 4))]),
                          nn.ReLU(), nn.Linear(4, 8))  # no same-class list: direct children, lists opened
    assert find_units(mixed) == [mixed[0], mixed[1][0], mixed[1][2], mixed[3]]
    assert find_units(nn.Linear(4, 4)) == []  # one unit: the whole model, as the root
    assert find_units(blocks, ["head", blocks.embed]) == [blocks.head, blocks.embed]
    with pytest.raises(UserError, match="zero3_units: 'blocks.0' lies inside 'blocks'; units must not nest"):
        find_units(blocks, ["blocks", "blocks.0"])


def test_zero3_units_names_the_units_and_a_wrong_name_is_one_line():
    engine = engine_for("logits", ["zero.stage=3"], zero3_units=["mix"])
    assert [len(g.params) for g in engine.strategy.groups] == [2, 3]  # mix; embed and head in the root
    assert train(engine, "logits", 3) == pytest.approx(train(engine_for("logits"), "logits", 3), rel=1e-5)
    with pytest.raises(UserError, match=r"zero3_units: 'mixer' is not a module of the model"):
        engine_for("logits", ["zero.stage=3"], zero3_units=["mixer"])


class TiedHead(nn.Module):
    """The head reuses the embedding's weight in the parent's forward, outside the embedding's own."""

    def __init__(self):
        super().__init__()
        self.embed, self.mix = nn.Embedding(VOCAB, 32), nn.Linear(32, 32)

    def forward(self, input_ids):
        return self.mix(self.embed(input_ids)) @ self.embed.weight.T


def test_stage3_a_parameter_used_outside_its_unit_says_how_to_name_the_units():
    recipe = recipe_from_dict(BASE, ["zero.stage=3"])
    tokens = token_batches(1)[0]
    with pytest.raises(UserError) as caught:
        initialize(recipe, model=TiedHead())(tokens)
    assert len(caught.value.lines) == 1
    assert "TiedHead.forward read a parameter outside the forward of the unit holding it" in caught.value.lines[0]
    assert "zero3_units=[module names]" in caught.value.lines[0]
    engine = initialize(recipe, model=TiedHead(), zero3_units=["mix"])  # the embedding stays in the root
    plain = initialize(recipe_from_dict(BASE), model=TiedHead())
    plain.model.load_state_dict(engine.strategy.full_parameters())
    assert float(engine(tokens).detach()) == pytest.approx(float(plain(tokens).detach()), rel=1e-6)


def test_the_memory_monitor_counts_a_user_models_states():
    from toolkit.observe.memory_monitor import MemoryMonitor

    engine = engine_for("output")
    monitor = MemoryMonitor(engine)
    train(engine, "output", 2)
    metrics = monitor.window_metrics(engine.global_step)
    monitor.close()
    p = sum(t.numel() for t in engine.model.parameters())
    # fp32, stage 0: 4P parameters, 4P gradients, 8P AdamW moments (plus torch's 4-byte step count per tensor)
    assert metrics["mem_params_bytes"] == metrics["mem_grads_bytes"] == 4 * p
    assert metrics["mem_optim_bytes"] == 8 * p + 4 * len(list(engine.model.parameters()))


# ---------------------------------------------------------------------------
# save_checkpoint / load_checkpoint in one process


@pytest.mark.parametrize("stage", [0, 2])
def test_save_and_load_checkpoint_resume_exactly_with_client_state(tmp_path, stage):
    overrides = [f"zero.stage={stage}"]
    engine = engine_for("logits", overrides)
    train(engine, "logits", 3)
    client = {"epoch": 2, "note": "mid-run", "ema": torch.arange(4.0), "seen": [1, 2, 3]}
    path = engine.save_checkpoint(tmp_path / "ckpt", client_state=client)
    assert path == tmp_path / "ckpt" / "step-000003"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000003"
    uninterrupted = train(engine, "logits", 3, seed=9)

    fresh = initialize(recipe_from_dict(BASE, overrides), model=TinyLM("logits", seed=1))
    loaded_path, loaded_client = fresh.load_checkpoint(tmp_path / "ckpt")
    assert loaded_path == path and fresh.global_step == 3
    assert loaded_client.keys() == client.keys() and loaded_client["seen"] == [1, 2, 3]
    assert torch.equal(loaded_client["ema"], client["ema"]) and loaded_client["note"] == "mid-run"
    assert train(fresh, "logits", 3, seed=9) == pytest.approx(uninterrupted, rel=1e-6)


def test_load_checkpoint_takes_the_tag_latest_names_and_a_given_tag(tmp_path):
    engine = engine_for("logits")
    train(engine, "logits", 1)
    engine.save_checkpoint(tmp_path, tag="warm", client_state={"which": "warm"})
    train(engine, "logits", 1)
    engine.save_checkpoint(tmp_path, tag="best", client_state={"which": "best"})
    fresh = engine_for("logits")
    assert fresh.load_checkpoint(tmp_path) == (tmp_path / "best", {"which": "best"})
    assert fresh.global_step == 2
    assert fresh.load_checkpoint(tmp_path, tag="warm") == (tmp_path / "warm", {"which": "warm"})
    assert fresh.global_step == 1


def test_load_checkpoint_reads_a_toolkit_run_directory(tmp_path):
    from toolkit.train.loop import run

    recipe = recipe_from_dict(BASE, ["training.max_steps=2"])
    run(recipe, tmp_path / "run", quiet=True)
    engine = initialize(recipe)
    path, client = engine.load_checkpoint(tmp_path / "run")
    assert path.name == "step-000002" and client == {} and engine.global_step == 2


def test_checkpoint_api_mistakes_are_one_line(tmp_path, capsys):
    engine = engine_for("logits")
    with pytest.raises(UserError, match="save_checkpoint: client_state: cannot store a TinyLM"):
        engine.save_checkpoint(tmp_path, client_state={"model": TinyLM()})
    with pytest.raises(UserError, match="save_checkpoint: tag 'a/b' is not a plain directory name"):
        engine.save_checkpoint(tmp_path, tag="a/b")
    assert engine.load_checkpoint(tmp_path / "empty") == (None, None)  # as DeepSpeed: a warning, nothing loaded
    assert "warning: load_checkpoint:" in capsys.readouterr().err
    engine.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(UserError, match="no such checkpoint directory"):
        engine.load_checkpoint(tmp_path / "ckpt", tag="step-000009")
    other = initialize(recipe_from_dict(BASE), model=nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)))
    with pytest.raises(UserError, match="the checkpoint does not fit this model"):
        other.load_checkpoint(tmp_path / "ckpt")


# ---------------------------------------------------------------------------
# 2 gloo ranks: a user model at stages 0-3 (children as units, named units), a ZeRO save loaded by 1 process

DIST_STEPS = 4


def _dist_rank(rank, world, port, out_dir):
    become_rank(rank, world, port)
    global_batches = token_batches(DIST_STEPS, rows=MICRO * world)
    results = {}
    for name, overrides, units in [("stage0", ["zero.stage=0"], None), ("stage1", ["zero.stage=1"], None),
                                   ("stage2", ["zero.stage=2"], None), ("stage3", ["zero.stage=3"], None),
                                   ("stage3-named", ["zero.stage=3"], ["mix"])]:
        recipe = recipe_from_dict(BASE, overrides, world_size=world)
        engine = initialize(recipe, model=TinyLM("loss", seed=rank), zero3_units=units)  # rank 0's weights win
        losses = [engine.train_batch([as_batch(b[rank::world], "loss")]).loss for b in global_batches]
        results[name] = {"losses": losses, "params": engine.strategy.full_parameters(),
                         "units": len(getattr(engine.strategy, "groups", ()))}
        if name == "stage2":
            engine.save_checkpoint(out_dir / "ckpt", client_state={"rank0_only": rank})
    if rank == 0:
        torch.save(results, out_dir / "results.pt")
    leave_rank()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):

    out_dir = tmp_path_factory.mktemp("engine-api-dist")
    fork_ranks(_dist_rank, 2, out_dir)
    return out_dir, torch.load(out_dir / "results.pt", weights_only=False)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["stage1", "stage2", "stage3", "stage3-named"])
def test_a_user_model_at_zero_stages_on_two_ranks_matches_stage_0(two_ranks, name):
    _, results = two_ranks
    want = results["stage0"]
    assert results[name]["losses"] == pytest.approx(want["losses"], rel=1e-5)
    for key, value in want["params"].items():
        torch.testing.assert_close(results[name]["params"][key], value, rtol=1e-5, atol=1e-5)
    if name.startswith("stage3"):  # the children embed, mix, head + the root; or mix + the root
        assert results[name]["units"] == {"stage3": 4, "stage3-named": 2}[name]


@pytest.mark.dist
def test_a_two_rank_zero_checkpoint_loads_in_one_process(two_ranks):
    out_dir, results = two_ranks
    engine = initialize(recipe_from_dict(BASE, ["zero.stage=0"]), model=TinyLM("loss", seed=5))
    path, client = engine.load_checkpoint(out_dir / "ckpt")
    assert path.name == f"step-{DIST_STEPS:06d}" and client == {"rank0_only": 0}
    assert sorted(p.name for p in path.glob("zero-rank-*")) == ["zero-rank-00000-of-00002.safetensors",
                                                                "zero-rank-00001-of-00002.safetensors"]
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), results["stage2"]["params"][name]), name


# ---------------------------------------------------------------------------
# The README's Python snippet, as written


def readme_python_snippet() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("From Python")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


@pytest.mark.slow
def test_the_readmes_python_snippet_runs_as_written(tmp_path):
    code = readme_python_snippet()
    assert "toolkit.initialize(recipe, model=" in code and "save_checkpoint" in code
    script = tmp_path / "snippet.py"
    script.write_text(code + "\nprint('client_state', client_state, 'step', engine.global_step)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "client_state {'epoch': 1} step 1" in done.stdout
    assert (tmp_path / "runs" / "demo" / "metrics.jsonl").is_file()
    assert (tmp_path / "runs" / "mine" / "step-000001" / "manifest.json").is_file()
