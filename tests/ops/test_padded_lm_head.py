"""The padded LM head (toolkit/ops/fused_modules.py): logits widened to aligned GEMM shapes, whose
extra columns the loss skips, train exactly like the model's own head (CPU, torch references)."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tests.ops.tiny_models import tiny_gpt2, tiny_llama
from toolkit.ops import custom_ops
from toolkit.ops.fused_modules import PaddedLMHead, pad_lm_head


def loss_and_grads(model, ids, classes=None):
    logits = model(input_ids=ids[:, :-1]).logits
    loss = custom_ops.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), classes=classes)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama])
def test_padded_head_trains_like_the_models_own_head(build):
    reference = build()
    padded = copy.deepcopy(reference)
    keys = list(padded.state_dict())
    head = pad_lm_head(padded)
    assert isinstance(head, PaddedLMHead) and (head.out_features, head.width) == (97, 128)
    assert list(padded.state_dict()) == keys
    if build is tiny_gpt2:  # the tie to the input embedding survives
        assert padded.lm_head.weight is padded.transformer.wte.weight
    ids = torch.randint(0, 97, (2, 17))
    assert torch.equal(padded(input_ids=ids).logits, reference(input_ids=ids).logits)  # unset: nn.Linear
    expected, expected_grads = loss_and_grads(reference, ids)
    head.padded = True
    assert padded(input_ids=ids).logits.shape == (2, 17, 128)
    loss, grads = loss_and_grads(padded, ids, classes=97)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (name, _), got, want in zip(reference.named_parameters(), grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)


def test_pad_lm_head_leaves_aligned_vocabularies_and_other_heads_alone():
    model = tiny_gpt2()
    assert pad_lm_head(model, multiple=97) is None
    assert type(model.lm_head) is torch.nn.Linear
    assert pad_lm_head(torch.nn.Linear(4, 5)) is None  # no output embedding to pad


def test_compile_traces_the_padded_head_without_graph_breaks():
    model = tiny_gpt2()
    head = pad_lm_head(model)
    ids = torch.randint(0, 97, (2, 16))

    def loss_fn(ids):
        head.padded = True
        try:
            logits = model(input_ids=ids[:, :-1]).logits
        finally:
            head.padded = False
        return custom_ops.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1), classes=97)

    expected = F.cross_entropy(model(input_ids=ids[:, :-1]).logits.reshape(-1, 97), ids[:, 1:].reshape(-1))
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    torch.testing.assert_close(compiled(ids), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cross_entropy", ["auto", "off"])
def test_engine_loss_over_a_padded_head_matches_the_unpadded_one(cross_entropy):
    from toolkit.runtime.engine import Engine
    from toolkit.recipe.load import load_recipe

    recipe = load_recipe("quickstart", ["training.device=cpu", f"kernels.cross_entropy={cross_entropy}"])
    plain, padded = Engine(recipe), Engine(recipe)
    assert plain._padded_head is None  # the CPU keeps the model's own head
    padded._padded_head = pad_lm_head(padded.model, multiple=96)
    assert padded._padded_head is not None
    batch = torch.randint(0, recipe.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(padded(batch), plain(batch), rtol=1e-6, atol=1e-6)
