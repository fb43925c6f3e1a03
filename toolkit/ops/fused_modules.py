"""Model surgery: swap transformers' GPT-2 / Llama modules for fused ones in place.

A swapped module keeps its parameters, buffers, hooks and state-dict keys (its
class is replaced by a subclass that only overrides `forward`), so checkpoints,
exports and the optimizer's parameter groups see the same model. The fused path
runs when the module's `fused` flag is set and the input is on CUDA (or
`reference_ops` is set: the custom ops' torch references then run on the CPU,
which is how CPU tests exercise the fused path); otherwise the original
transformers forward runs unchanged, bit for bit.

NOTE: under autocast the fused norms write their output directly in the autocast
dtype. Every consumer of a GPT-2 / Llama norm output is a matmul that autocast
would cast to that dtype anyway, so the result is the same and a cast kernel and
its fp32 buffer disappear; gradients are unchanged (the cast's backward is exact).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.ops import custom_ops

# transformers activation classes that compute gelu_new (tanh approximation).
_TANH_GELUS = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh"}


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


class _Fused:
    """Mixin state: `fused` (use the custom ops) and `reference_ops` (also on the CPU, for tests)."""
    fused = False
    reference_ops = False

    def _use_ops(self, x: torch.Tensor) -> bool:
        return self.fused and (x.is_cuda or self.reference_ops)


class FusedLayerNorm(_Fused, nn.LayerNorm):
    """nn.LayerNorm whose forward is toolkit::norm_fwd on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_ops(x):
            return custom_ops.layer_norm(x, self.weight, self.bias, self.eps, out_dtype=_autocast_dtype(x))
        return super().forward(x)


def _fused_rms_forward(self, x: torch.Tensor) -> torch.Tensor:
    if self._use_ops(x):
        out_dtype = _autocast_dtype(x) or torch.promote_types(self.weight.dtype, x.dtype)
        return custom_ops.rms_norm(x, self.weight, self.variance_epsilon, out_dtype=out_dtype)
    return super(type(self), self).forward(x)


def _fused_gelu_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if self._use_ops(hidden_states):
        # Conv1D is addmm(bias, x, W): the matmul without bias, then bias + GELU fused.
        h = hidden_states @ self.c_fc.weight
        return self.dropout(self.c_proj(custom_ops.bias_gelu(h, self.c_fc.bias)))
    return super(type(self), self).forward(hidden_states)


_positional_names: dict[type, list[str]] = {}  # a block class -> its forward's positional names after hidden_states


def _call_arguments(cls: type, args: tuple, kwargs: dict) -> dict:
    """A block's call as keywords, by the names its transformers version gives its forward (5.17's past_key_values,
    5.2x's cache)."""
    names = _positional_names.get(cls)
    if names is None:
        parameters = list(inspect.signature(cls.forward).parameters.values())[2:]  # after self, hidden_states
        names = _positional_names[cls] = [p.name for p in parameters
                                          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    call = dict(zip(names, args))
    call.update(kwargs)
    return call


def _training_call(call: dict) -> bool:
    """No cache and no cross-attention: the blocks' path the fused forwards below take."""
    return (call.get("cache") is None and call.get("past_key_values") is None and not call.get("use_cache")
            and call.get("encoder_hidden_states") is None)


def _fused_gpt2_block_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """GPT2Block's forward with the attention's residual add and ln_2 as one op (norm_ops.add_layer_norm), whose
    backward is one kernel; with a cache or cross-attention, or ln_2 not fused, transformers' own."""
    parent = super(type(self), self)
    call = _call_arguments(type(self).__bases__[1], args, kwargs)  # Fused<cls>'s bases: (_Fused, cls)
    ln_2 = self.ln_2
    if not (self._use_ops(hidden_states) and isinstance(ln_2, FusedLayerNorm) and ln_2._use_ops(hidden_states)
            and _training_call(call)):
        return parent.forward(hidden_states, *args, **kwargs)
    call.pop("encoder_hidden_states", None)
    call.pop("encoder_attention_mask", None)
    attn_output, _ = self.attn(self.ln_1(hidden_states), **call)
    hidden_states, h = custom_ops.add_layer_norm(attn_output, hidden_states, ln_2.weight, ln_2.bias, ln_2.eps,
                                                 out_dtype=_autocast_dtype(attn_output))
    return hidden_states + self.mlp(h)


def _fused_llama_layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """LlamaDecoderLayer's forward with the attention's residual add and post_attention_layernorm as one op
    (norm_ops.add_rms_norm), whose backward is one kernel; with a cache, or that norm not fused, transformers' own."""
    parent = super(type(self), self)
    call = _call_arguments(type(self).__bases__[1], args, kwargs)
    norm = self.post_attention_layernorm
    if not (self._use_ops(hidden_states) and isinstance(norm, _Fused) and norm._use_ops(hidden_states)
            and _training_call(call)):
        return parent.forward(hidden_states, *args, **kwargs)
    attn_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **call)
    out_dtype = _autocast_dtype(attn_output) or torch.promote_types(norm.weight.dtype, attn_output.dtype)
    hidden_states, h = custom_ops.add_rms_norm(attn_output, hidden_states, norm.weight, norm.variance_epsilon,
                                               out_dtype=out_dtype)
    return hidden_states + self.mlp(h)


_subclasses: dict[tuple[type, str], type] = {}


def _fused_subclass(cls: type, forward) -> type:
    """Fused<cls> overriding forward (cached; the name keeps the norm suffix the optimizer groups by)."""
    key = (cls, forward.__name__)
    if key not in _subclasses:
        _subclasses[key] = type(f"Fused{cls.__name__}", (_Fused, cls), {"forward": forward, "__module__": __name__})
    return _subclasses[key]


def _swap(module: nn.Module, cls: type, fused: bool, reference_ops: bool) -> None:
    module.__class__ = cls
    module.fused = fused
    module.reference_ops = reference_ops


def swap_fused_modules(model: nn.Module, use: dict[str, bool], reference_ops: bool = False) -> dict[str, int]:
    """Swap the modules of the kernels in `use` (name -> fused?) in place; returns how many of each were swapped.

    Kernels: layernorm (plain nn.LayerNorm over one dim, with bias), rmsnorm (transformers *RMSNorm with a
    weight and variance_epsilon), bias_gelu (GPT-2 MLPs whose activation is gelu_new). With a norm's kernel, the
    blocks (GPT2Block, LlamaDecoderLayer: "residual_norm") also take the attention's residual add and the norm
    after it as one op, whose backward is one kernel, where that norm is swapped too.
    """
    counts = {"layernorm": 0, "rmsnorm": 0, "bias_gelu": 0, "residual_norm": 0}
    for module in model.modules():
        cls = type(module)
        if issubclass(cls, _Fused):
            continue
        if "layernorm" in use and cls is nn.LayerNorm:  # a subclass may have its own forward: leave it
            if len(module.normalized_shape) == 1 and module.weight is not None and module.bias is not None:
                _swap(module, FusedLayerNorm, use["layernorm"], reference_ops)
                counts["layernorm"] += 1
        elif "rmsnorm" in use and cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") \
                and isinstance(getattr(module, "weight", None), nn.Parameter) and module.weight.dim() == 1:
            _swap(module, _fused_subclass(cls, _fused_rms_forward), use["rmsnorm"], reference_ops)
            counts["rmsnorm"] += 1
        elif "bias_gelu" in use and cls.__name__ == "GPT2MLP" and type(module.act).__name__ in _TANH_GELUS:
            _swap(module, _fused_subclass(cls, _fused_gelu_mlp_forward), use["bias_gelu"], reference_ops)
            counts["bias_gelu"] += 1
        elif "layernorm" in use and cls.__name__ == "GPT2Block" and type(getattr(module, "ln_2", None)) is nn.LayerNorm:
            _swap(module, _fused_subclass(cls, _fused_gpt2_block_forward), use["layernorm"], reference_ops)
            counts["residual_norm"] += 1
        elif "rmsnorm" in use and cls.__name__ == "LlamaDecoderLayer" \
                and type(getattr(module, "post_attention_layernorm", None)).__name__.endswith("RMSNorm"):
            _swap(module, _fused_subclass(cls, _fused_llama_layer_forward), use["rmsnorm"], reference_ops)
            counts["residual_norm"] += 1
    return counts


class PaddedLMHead(nn.Linear):
    """An LM head whose logits come out `width` columns wide (zero weight rows appended) while
    `padded` is set. cuBLAS multiplies GPT-2's odd vocabulary (50257) with unaligned kernels (its three
    LM-head GEMMs took 30.6 of a 63.5 ms GPT-2 124M step on an H200); rows a multiple of 128 wide start
    on 16-byte boundaries, which its aligned kernels need (50304 wide: 4.7 ms, and the eager step 1.65x
    faster; benchmarks/RESULTS.md). The extra columns are no classes: the loss must skip them
    (custom_ops.cross_entropy's `classes`, or a slice). Unset (generation, exports, a recipe's own
    loss), it is nn.Linear."""
    width = 0
    padded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.padded:
            return super().forward(x)
        weight = self.weight
        dtype = _autocast_dtype(x)
        if dtype is not None:
            weight = weight.to(dtype)  # the cast autocast makes anyway: pad the narrower copy
        extra = self.width - weight.shape[0]
        bias = None if self.bias is None else F.pad(self.bias.to(weight.dtype), (0, extra))
        return F.linear(x, F.pad(weight, (0, 0, 0, extra)), bias)


def pad_lm_head(model: nn.Module, multiple: int = 128) -> PaddedLMHead | None:
    """Make the model's output embedding (an nn.Linear) a PaddedLMHead of the next multiple of
    `multiple` columns, in place (parameters, ties and state-dict keys unchanged); None where it is
    no plain nn.Linear or already a multiple."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or head.out_features % multiple == 0:
        return None
    head.__class__ = PaddedLMHead
    head.width = -(-head.out_features // multiple) * multiple
    return head
