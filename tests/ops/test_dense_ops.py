"""GPT-2's dense layers through cuBLASLt's epilogues (toolkit/ops/dense_ops.py), without a GPU: the autograd
Functions over the extension's torch reference pass gradcheck, and a model swapped to them trains as transformers'
own. The extension itself is tested on the GPU (tests/ops/test_kernels_cuda.py)."""
import copy

import pytest
import torch

from toolkit.ops import dense_ops, loader
from toolkit.ops.fused_modules import swap_fused_modules
from tests.ops.tiny_models import tiny_gpt2

REFERENCE = dense_ops.REFERENCE


def test_the_mlp_and_conv1d_functions_pass_gradcheck():
    d = dict(dtype=torch.float64, requires_grad=True)
    x, w_fc, b_fc = torch.randn(2, 3, 8, **d), torch.randn(8, 16, **d), torch.randn(16, **d)
    w_proj, b_proj = torch.randn(16, 8, **d), torch.randn(8, **d)
    assert torch.autograd.gradcheck(lambda *a: dense_ops.gelu_mlp(*a, REFERENCE), (x, w_fc, b_fc, w_proj, b_proj))
    assert torch.autograd.gradcheck(lambda *a: dense_ops.conv1d(*a, REFERENCE), (x, w_fc, b_fc))


def test_a_gpt2_on_the_dense_path_gives_transformers_logits_and_gradients():
    reference = tiny_gpt2()
    dense = copy.deepcopy(reference)
    counts = swap_fused_modules(dense, {"dense": True}, reference_ops=True)
    assert counts["dense"] == 2 + 2 * 4  # two MLPs, and every Conv1D: c_attn, c_proj, c_fc, c_proj per block
    ids = torch.randint(0, 97, (2, 16))
    out_ref, out = reference(input_ids=ids).logits, dense(input_ids=ids).logits
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out_ref.square().mean().backward()
    out.square().mean().backward()
    for (name, a), b in zip(reference.named_parameters(), dense.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_without_the_reference_a_cpu_call_takes_transformers_path_bit_for_bit():
    reference = tiny_gpt2()
    dense = copy.deepcopy(reference)
    swap_fused_modules(dense, {"dense": True})
    ids = torch.randint(0, 97, (2, 16))
    assert torch.equal(dense(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.parametrize("make, ok", [
    (lambda: torch.zeros(4, 16, dtype=torch.bfloat16), False),  # on the CPU
    (lambda: torch.zeros(4, 16), False),  # fp32
])
def test_usable_takes_only_16_bit_cuda_tensors(make, ok):
    assert dense_ops.usable(make()) is ok


def test_dense_is_a_gpt2_kernel_a_recipe_can_turn_off():
    from toolkit.recipe.load import load_recipe

    assert "dense" in loader.KERNELS and "dense" in loader.FAMILY_KERNELS["gpt2"]
    assert "dense" not in loader.FAMILY_KERNELS["llama"]
    assert load_recipe("quickstart", ["kernels.dense=auto"]).kernels.dense == "auto"
    assert load_recipe("quickstart").kernels.dense == "off"  # until measured on a GPU
