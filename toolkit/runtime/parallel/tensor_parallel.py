"""Tensor parallelism for the GPT-2 and Llama families, Megatron style, through DTensor's
parallelize_module: in each block the attention's query/key/value projection and the MLP's first layer
are column-parallel (each rank computes its heads / its slice of the hidden width) and the attention
output and the MLP's second layer are row-parallel (one all-reduce joins the partial sums), so a block
costs one all-reduce in forward and one in backward per sublayer. Embeddings, norms and the LM head stay
replicated (the tiny vocabularies here do not pay for a vocabulary-parallel split).

GPT-2 uses transformers' Conv1D, whose weight is [in, out] (nn.Linear's transposed), and fuses q, k and
v in one `c_attn`: the column split is of weight dim 1, and c_attn's columns are first reordered so each
rank's block holds its own heads' q, k and v (`qkv_order`). `ShardLayout` records per parameter how its
full tensor maps to a rank's shard, which checkpoints use to stay layout-independent.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


@dataclass(frozen=True)
class ShardLayout:
    """How a full parameter becomes this rank's shard: reorder along `dim` by `order` (or not), then take
    chunk tp_rank of tp along `dim`."""
    dim: int
    order: torch.Tensor | None = None

    def shard(self, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        """This rank's shard of the full tensor."""
        if self.order is not None:
            full = full.index_select(self.dim, self.order)
        return full.chunk(tp, dim=self.dim)[tp_rank]

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (in tp-rank order)."""
        full = torch.cat(shards, dim=self.dim)
        if self.order is not None:
            full = full.index_select(self.dim, torch.argsort(self.order))
        return full


def qkv_order(width: int, tp: int) -> torch.Tensor:
    """Column order of a fused [q | k | v] projection putting rank i's q, k and v slices together."""
    part = width // tp
    return torch.cat([torch.arange(part) + j * width + i * part for i in range(tp) for j in range(3)])


def _conv1d_partition(weight_dim: int, bias_placement):
    def partition(name, module, mesh):
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(weight_dim)])))
        if module.bias is not None:
            module.register_parameter("bias", nn.Parameter(distribute_tensor(module.bias, mesh, [bias_placement])))
    return partition


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for transformers' Conv1D (weight [in, out]: output columns are weight dim 1)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, _conv1d_partition(1, Shard(0)),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for transformers' Conv1D (input rows are weight dim 0; the bias is added once)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel sets it for nn.Linear
        return distribute_module(module, device_mesh, _conv1d_partition(0, Replicate()),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _gpt2_block(block: nn.Module, prefix: str, tp: int, layouts: dict) -> dict:
    attn = block.attn
    width = attn.split_size
    order = qkv_order(width, tp)
    with torch.no_grad():  # c_attn's columns grouped by rank before the column split
        attn.c_attn.weight.copy_(attn.c_attn.weight.index_select(1, order))
        attn.c_attn.bias.copy_(attn.c_attn.bias.index_select(0, order))
    attn.split_size, attn.num_heads = width // tp, attn.num_heads // tp  # the forward reads them per rank
    layouts.update({f"{prefix}.attn.c_attn.weight": ShardLayout(1, order), f"{prefix}.attn.c_attn.bias":
                    ShardLayout(0, order), f"{prefix}.attn.c_proj.weight": ShardLayout(0),
                    f"{prefix}.mlp.c_fc.weight": ShardLayout(1), f"{prefix}.mlp.c_fc.bias": ShardLayout(0),
                    f"{prefix}.mlp.c_proj.weight": ShardLayout(0)})
    return {"attn.c_attn": Conv1DColwise(), "attn.c_proj": Conv1DRowwise(),
            "mlp.c_fc": Conv1DColwise(), "mlp.c_proj": Conv1DRowwise()}


def _llama_block(block: nn.Module, prefix: str, tp: int, layouts: dict) -> dict:
    # nn.Linear weight is [out, in]: column-parallel splits dim 0, row-parallel dim 1 (Llama has no biases)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        layouts[f"{prefix}.{name}.weight"] = ShardLayout(0)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        layouts[f"{prefix}.{name}.weight"] = ShardLayout(1)
    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def blocks_of(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name prefix, the ModuleList of transformer blocks) of a GPT-2 or Llama causal LM."""
    if hasattr(model, "transformer"):
        return "transformer.h", model.transformer.h
    return "model.layers", model.model.layers


def apply_tensor_parallel(model: nn.Module, family: str, tp_mesh, tp: int) -> dict[str, ShardLayout]:
    """Shard every block still in `model` over `tp_mesh` (in place); returns each sharded parameter's layout."""
    layouts: dict[str, ShardLayout] = {}
    plan_of = _gpt2_block if family == "gpt2" else _llama_block
    prefix, blocks = blocks_of(model)
    for index, block in blocks._modules.items():
        parallelize_module(block, tp_mesh, plan_of(block, f"{prefix}.{index}", tp, layouts))
    return layouts
