"""The step memory timeline has the shape of a training step: the forward rises to a peak at the
forward/backward boundary, the backward falls below where it began, the optimizer step's temporaries
rise above its start and the step ends where it began; activation checkpointing lowers the forward's end."""
import pytest
import torch

from toolkit.observe.notebook import saved_activation_bytes
from toolkit.observe.step_memory_timeline import PHASES, record_step_memory
from toolkit.recipe.load import load_recipe
from toolkit.runtime.engine import Engine

SMALL = ["model.n_layer=2", "training.device=cpu"]


def timeline_of(overrides):
    recipe = load_recipe("quickstart", [*SMALL, *overrides])
    engine = Engine(recipe)
    batch = torch.randint(0, recipe.data.vocab_size, (recipe.batch.micro_batch_per_rank, recipe.data.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))
    engine.train_batch([batch])  # warm-up: the optimizer states exist before the recorded step
    return record_step_memory(engine, batch)


def test_forward_rises_backward_falls_and_the_peak_is_at_the_forward_backward_boundary():
    timeline = timeline_of([])
    assert list(timeline.bounds) == list(PHASES) and timeline.source == "live tensor storages"
    assert all(timeline.phase(name) for name in PHASES)
    forward_end = timeline.level_at("forward", end=True)
    assert forward_end > 10 * max(timeline.level_at("forward"), 1)  # the activations pile up
    assert timeline.level_at("backward", end=True) < 0.1 * timeline.level_at("backward")  # and are freed
    first, last = timeline.bounds["backward"]
    at_peak = timeline.bytes.index(timeline.peak)
    assert timeline.peak_phase() == "backward" and at_peak - first < 0.25 * (last - first)
    assert timeline.peak >= forward_end


def test_the_optimizer_step_rises_above_its_start_and_ends_near_where_the_step_began():
    timeline = timeline_of([])
    assert timeline.rise("optimizer step") > 0  # AdamW's temporaries
    # stage 0 frees the gradients after the step: back to the start, but for a few scalars (9 bytes measured)
    assert timeline.bytes[-1] < min(timeline.level_at("optimizer step"), 1024)


def test_activation_checkpointing_ends_the_forward_lower():
    full, checkpointed = timeline_of([]), timeline_of(["model.activation_checkpointing=true"])
    assert checkpointed.level_at("forward", end=True) < 0.5 * full.level_at("forward", end=True)
    assert checkpointed.peak < full.peak


def test_the_bytes_saved_for_backward_are_what_the_forward_of_the_timeline_keeps():
    recipe = load_recipe("quickstart", SMALL)
    engine = Engine(recipe)
    batch = torch.randint(0, recipe.data.vocab_size, (recipe.batch.micro_batch_per_rank, recipe.data.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))
    engine.train_batch([batch])
    saved = saved_activation_bytes(engine, batch, train=True)
    forward_end = record_step_memory(engine, batch).level_at("forward", end=True)
    # what the forward leaves alive is what autograd keeps, plus outputs it does not save (6% measured)
    assert saved <= forward_end <= 1.1 * saved, (saved, forward_end)


@pytest.mark.cuda
def test_on_cuda_the_samples_are_the_allocator_and_have_the_same_shape():
    timeline = timeline_of(["training.device=cuda"])
    assert timeline.source == "CUDA allocator"
    assert timeline.level_at("forward", end=True) > timeline.level_at("forward")
    assert timeline.level_at("backward", end=True) < 0.5 * timeline.level_at("backward")
    assert timeline.peak_phase() == "backward"
