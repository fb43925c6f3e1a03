"""ZeRO stage 3: parameters partitioned too. A rank keeps only its chunk of every
parameter; whole parameters exist only while a unit computes.

Units: each transformer block (the elements of the model's largest ModuleList
of blocks) and one root unit for everything else (embeddings, final norm, head;
GPT-2's tied wte / lm_head is one Parameter and so one slot of the root). Any
other model: the rule in `find_units` (named units, else that ModuleList, else
each direct child, else the whole model as the root). Each
unit is a FlatGroup (flat.py) whose full buffer's storage is resized to 0 when
released; the parameters stay views into it, so the autograd graph, saved
tensors and tied weights keep working across release and re-gather.

Schedule, per micro-step:
  forward   block pre-hook: gather (waiting for a prefetch), prefetch the next
            zero.prefetch_units blocks; post-hook: release. The root is gathered
            for the whole forward (it opens and closes it) and, when backward
            follows, until backward has finished with it.
  backward  a hook on the block's output gradient gathers it again (and prefetches
            the blocks before it); when every parameter of a unit has its gradient
            (post-accumulate-grad hooks) the unit's gradient is reduce-scattered
            into the rank's fp32 shard and its parameters released.
  step      AdamW on the shard; the new weights are gathered lazily next forward.
Activation checkpointing works: the recomputed forward runs inside backward
(detected with autograd's graph task id), where nothing is released.
NOTE: a unit is the reduce bucket here (zero.reduce_bucket_size applies to stages
0-2): a unit's gradient is complete exactly when its backward is, and the
reduce-scatter of a unit is one collective on its flat buffer.
torch.compile is refused with stage 3 (toolkit/runtime/engine.py).
"""
from __future__ import annotations

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.distributed import DistInfo
from toolkit.runtime.communicator import Communicator
from toolkit.runtime.strategy import weak_method_hook
from toolkit.runtime.zero.flat import FlatGroup, decay_param_ids, muon_ids_for
from toolkit.runtime.zero.param_offload import make_weights
from toolkit.runtime.zero.sharded import ShardedStrategy
from toolkit.specs import OptimizerSpec, ZeroSpec

RELEASED, IN_FLIGHT, GATHERED = "released", "in flight", "gathered"


def find_units(model: nn.Module, names=None) -> list[nn.Module]:
    """The modules whose parameters are gathered together, by this rule (what is left is the root unit):

    1. `names` (initialize(..., zero3_units=[...])): those modules, by their name in model.named_modules()
       (or the modules themselves);
    2. else the elements of the nn.ModuleList of same-class modules holding the most parameters (a
       transformer's blocks);
    3. else each direct child that holds parameters, when there are at least two (the elements of a child
       ModuleList or ModuleDict, which is never called itself);
    4. else none: the whole model is one unit (gathered for the whole forward and backward).
    A unit's parameters must be used only inside its own forward (a weight tied across units goes to the root).
    """
    if names is not None:
        return _named_units(model, names)
    best, best_size = [], 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = list(module), size
    if best:
        return best
    children = []
    for child in model.children():
        children += list(child.children()) if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
    children = [child for child in children if any(p.requires_grad for p in child.parameters())]
    return children if len(children) >= 2 else []


def _named_units(model: nn.Module, names) -> list[nn.Module]:
    """zero3_units -> modules; a UserError for a name the model lacks or a unit inside another."""
    by_name = dict(model.named_modules())
    name_of = {id(m): n for n, m in by_name.items()}
    units = []
    for item in names:
        if isinstance(item, nn.Module):
            if id(item) not in name_of:
                raise UserError(f"zero3_units: a {type(item).__name__} that is not a module of the model")
            item = name_of[id(item)]
        if not isinstance(item, str) or item not in by_name or item == "":
            known = ", ".join(repr(n) for n in list(by_name)[1:6])
            raise UserError(f"zero3_units: {item!r} is not a module of the model (its modules are named like "
                            f"{known}, ...: model.named_modules())")
        units.append(item)
    for a in units:
        for b in units:
            if a != b and b.startswith(a + "."):
                raise UserError(f"zero3_units: {b!r} lies inside {a!r}; units must not nest")
    return [by_name[n] for n in dict.fromkeys(units)]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


class Stage3Strategy(ShardedStrategy):
    """ZeRO stage 3 over the process group in `info`."""

    stage = 3
    group_kind = "units"

    def __init__(self, model: nn.Module, zero: ZeroSpec, optimizer: OptimizerSpec, device: torch.device,
                 info: DistInfo, units=None, comm: Communicator | None = None, grad_accum_steps: int = 1,
                 grad_clip: float = 0.0):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        dtype = named[0][1].dtype
        decay_ids = decay_param_ids(model)
        self.blocks = find_units(model, units)
        # A parameter in more than one unit (a tied weight) belongs to the root, gathered all along.
        owners: dict[int, int] = {}
        for block in self.blocks:
            for p in block.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
        in_block = {pid for pid, count in owners.items() if count == 1}
        block_ids = [{id(p) for p in block.parameters()} & in_block for block in self.blocks]
        per_block = [[(n, p) for n, p in named if id(p) in ids] for ids in block_ids]
        root = [(n, p) for n, p in named if id(p) not in in_block]
        muon_ids = muon_ids_for(model, optimizer.type)
        groups = [FlatGroup(b, decay_ids, info.world_size, muon_ids) for b in per_block]
        self.root = len(groups)
        groups.append(FlatGroup(root, decay_ids, info.world_size, muon_ids))
        super().__init__(zero, optimizer, device, info, groups, dtype, comm or Communicator(info, device),
                         grad_accum_steps, grad_clip)
        self.model = model
        self.prefetch = zero.prefetch_units
        # This rank's chunk of every unit, contiguous, on the tier zero.offload_param names (param_offload.py);
        # then the unit's full buffer on the device, released at once.
        # NOTE: released before the gradient shard and the optimizer's device part exist, so the device never holds
        # the whole model beside them (a 28B model's bf16 weights are 53 GiB: issue 35's ZeRO-Infinity run)
        self.weights = make_weights(zero.offload_param, self.layout, dtype, device, self.swap_dir, info.rank)
        self.full: list[torch.Tensor] = []
        self.state: list[str] = []
        self._works: dict[int, object] = {}
        self._fetches: dict[int, object] = {}   # units whose chunk is on its way to the device
        self._sources: dict[int, torch.Tensor] = {}  # the chunk a gather in flight reads
        for gi, g in enumerate(groups):
            full = torch.empty(g.padded_numel, dtype=dtype, device=device)
            g.flatten_into(full, [p.detach() for p in g.params])
            g.point_params_at(full)
            self.weights.write(gi, 0, full[slice(*g.chunk_range(info.rank))])
            self.full.append(full)
            self.state.append(GATHERED)
            self._release(gi)
        self.param_chunks = self.weights.chunks  # empty under offload_param nvme: the chunks are in the file
        self.grad_shard = torch.zeros(self.layout.numel, dtype=self.grad_dtype, device=device)
        self.grad_chunks = [self.layout.chunk_of(self.grad_shard, g) for g in range(len(groups))]
        self._init_master()
        self.peak_gathered = 0  # most units holding whole parameters at once (root included)
        self.forward_order = list(range(len(self.blocks)))  # replaced by the order seen in the first forward
        self._seen_order: list[int] = []
        self._group_of = {id(p): gi for gi, g in enumerate(groups) for p in g.params}
        self._reset_round()
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: self._before_block(i))
            block.register_forward_hook(lambda m, args, out, i=i: self._after_block(i, out))
        model.register_forward_pre_hook(lambda m, args: self._gather(self.root))
        model.register_forward_hook(lambda m, args, out: self._after_model())
        for p in (p for g in groups for p in g.params):
            p.register_post_accumulate_grad_hook(weak_method_hook(self._on_grad_ready))

    # -- gather / release -------------------------------------------------------------

    def _gather_async(self, g: int) -> None:
        if self.state[g] != RELEASED:
            return
        if self.groups[g].padded_numel == 0:  # a unit without parameters (a model that is all blocks)
            self.state[g] = GATHERED
            return
        full = self.full[g]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self._fetches[g] = self.weights.fetch(g)  # swap: the read starts now, on the I/O threads
        if self.weights.tier != "nvme":
            self._launch_gather(g)
        self.state[g] = IN_FLIGHT
        self.peak_gathered = max(self.peak_gathered, self.gathered_units())

    def _launch_gather(self, g: int) -> None:
        # NOTE: a swapped unit's collective starts in _gather, once its read is done: every rank gathers
        # units in the same order either way, so the collectives still match across ranks.
        chunk = self.weights.fetched(self._fetches.pop(g))
        if self.info.active:
            self._works[g] = self.comm.all_gather_flat(self.full[g], chunk)
            self._sources[g] = chunk  # kept until the collective is done (a device copy under offload_param)
        else:
            self.full[g].copy_(chunk)

    def _gather(self, g: int) -> None:
        self._gather_async(g)
        if self.state[g] == IN_FLIGHT:
            if g in self._fetches:
                self._launch_gather(g)
            work = self._works.pop(g, None)
            if work is not None:
                work.wait()
            self._sources.pop(g, None)
            self.state[g] = GATHERED

    def _release(self, g: int) -> None:
        if self.state[g] == IN_FLIGHT:
            self._gather(g)  # a collective in flight must finish before its buffer goes
        self.full[g].untyped_storage().resize_(0)
        self.state[g] = RELEASED

    def _prefetch(self, order: list[int], position: int) -> None:
        for g in order[position + 1:position + 1 + self.prefetch]:
            self._gather_async(g)

    # -- forward and backward hooks ------------------------------------------------------

    def _before_block(self, i: int) -> None:
        if _in_backward():  # activation-checkpointing recompute: gathered by the backward hook
            self._gather(i)
            return
        if not self._seen_order or self._seen_order[-1] != i:
            self._seen_order.append(i)
        self._gather(i)
        order = self.forward_order
        self._prefetch(order, order.index(i))

    def _after_block(self, i: int, output) -> None:
        if _in_backward():
            return
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, i=i: self._before_block_backward(i))
        self._release(i)

    def _before_block_backward(self, i: int) -> None:
        self._gather(i)
        order = self.forward_order[::-1]
        self._prefetch(order, order.index(i))

    def _after_model(self) -> None:
        if len(self._seen_order) == len(self.blocks):
            self.forward_order = list(self._seen_order)
        self._seen_order = []
        if not torch.is_grad_enabled():  # no backward follows (evaluation): the root goes now
            self._release(self.root)

    # -- gradients: reduce-scatter per unit -------------------------------------------------

    def _reset_round(self) -> None:
        self._missing = [len(g.params) for g in self.groups]
        self._pending: list[tuple[int, object, torch.Tensor]] = []

    def begin_micro_step(self, boundary: bool) -> None:
        """Called before backward (stage 3 reduces every micro-step)."""
        self._begin_round(boundary)
        self._reset_round()

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        g = self._group_of[id(param)]
        self._missing[g] -= 1
        if self._missing[g] == 0:
            self._reduce(g)

    def _reduce(self, g: int) -> None:
        group = self.groups[g]
        self._missing[g] = -1  # reduced this round
        if group.padded_numel == 0:
            return
        source = torch.zeros(group.padded_numel, dtype=self.param_dtype, device=self.device)
        for p, view in zip(group.params, group.views(source)):
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = None
        self._release(g)
        if not self.info.active:
            self._queue_reduced(g, None, source)
            return
        source.div_(self.info.world_size)  # NOTE: pre-divide: exact for power-of-two worlds
        out = torch.empty(group.chunk, dtype=source.dtype, device=self.device)
        self._queue_reduced(g, self.comm.reduce_scatter_flat(out, source), out)

    def end_micro_step(self) -> None:
        """Called after backward: reduce units whose gradients never all came, wait, accumulate."""
        for g in range(len(self.groups)):
            if self._missing[g] >= 0:
                self._reduce(g)
        self._drain(block=True)
        for g in range(len(self.groups)):
            if self.state[g] != RELEASED:
                self._release(g)
        self._reset_round()

    def _gathered_all_along(self) -> int:
        return self.groups[self.root].padded_numel

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by name (a collective: every rank must call it)."""
        out = {}
        for g, group in enumerate(self.groups):
            held = self.state[g] != RELEASED
            self._gather(g)
            for slot, view in zip(group.slots, group.views(self.full[g])):
                out[slot.name] = view.detach().clone()
            if not held:
                self._release(g)
        return out

    # -- accounting ------------------------------------------------------------------------

    def gathered_units(self) -> int:
        """How many units hold their full parameters right now."""
        return sum(state != RELEASED for state in self.state)

    def param_tensors(self) -> list[torch.Tensor]:
        return [*self.weights.resident_tensors(), *self.full]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [self.grad_shard]
