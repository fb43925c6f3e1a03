"""Model construction from a `ModelSpec`: a transformers architecture built from
its config (never downloaded), or a local pretrained folder. Nothing about
training lives here; kernels swap modules in later (toolkit/ops/loader.py)."""
from __future__ import annotations

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.specs import ModelSpec


def build_config(spec: ModelSpec):
    """The transformers config for a spec (GPT2Config or LlamaConfig)."""
    from transformers import GPT2Config, LlamaConfig

    if spec.family == "gpt2":
        return GPT2Config(
            vocab_size=spec.vocab_size, n_positions=spec.max_positions, n_embd=spec.n_embd,
            n_layer=spec.n_layer, n_head=spec.n_head, n_inner=spec.intermediate_size,
            resid_pdrop=spec.dropout, embd_pdrop=spec.dropout, attn_pdrop=spec.dropout,
            use_cache=False, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=None,  # the data's tokenizer owns special tokens
        )
    return LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.n_embd, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, num_key_value_heads=spec.n_kv_head,
        max_position_embeddings=spec.max_positions, attention_dropout=spec.dropout,
        tie_word_embeddings=False, use_cache=False,
    )


def build_model(spec: ModelSpec, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """A freshly initialised (seeded) or locally loaded causal LM in fp32, on `device`.

    A fresh model is initialised on `device` itself: a multi-billion-parameter model would
    otherwise take minutes of CPU init and its fp32 size in host memory before moving.
    """
    device = torch.device(device)
    from transformers import AutoModelForCausalLM

    if spec.pretrained is not None:
        try:
            model = AutoModelForCausalLM.from_pretrained(spec.pretrained, local_files_only=True,
                                                         dtype=torch.float32)
        except (OSError, ValueError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"recipe.model.pretrained: {spec.pretrained}: cannot load: {first_line}") from None
    else:
        from transformers import GPT2LMHeadModel, LlamaForCausalLM

        cls = GPT2LMHeadModel if spec.family == "gpt2" else LlamaForCausalLM
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), torch.device(device):
            torch.manual_seed(seed)
            model = cls(build_config(spec))
    if spec.activation_checkpointing:
        # NOTE: transformers 5.2x renamed gradient_checkpointing_enable; 5.17 (the GPU machines) has only the old name.
        non_reentrant = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
    return model


def count_parameters(model: nn.Module) -> int:
    """Distinct trainable parameters (tied weights once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
