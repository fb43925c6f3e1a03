"""World-size independent ZeRO checkpoints: per-parameter pieces, not flat shards.

Each rank writes one safetensors file, zero-rank-RRRRR-of-WWWWW.safetensors,
holding for every parameter it owns a piece of (a range [start, stop) of the
flattened parameter) three fp32 1-D tensors: `param/<name>` (the fp32 master
weights), `exp_avg/<name>` and `exp_avg_sq/<name>`. The file's metadata names
each piece's range and each parameter's shape. Padding and the flat layout of
the saving world size never reach the file, so any stage at any world size can
read back exactly the ranges it owns (`ShardFilesReader.read`), and `toolkit
export` can consolidate whole tensors (`consolidated_model_state`).

A stage 0 (or one-process) checkpoint holds the engine's plain model and torch
optimizer state dicts instead; `FullStateReader` serves the same ranges from
those, so a stage 0 checkpoint resumes under ZeRO and the other way round.

What does not live here: the checkpoint directory, manifest and atomic rename
(toolkit/checkpoint/checkpointer.py), which layout a strategy uses (flat.py, the strategies).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from toolkit.errors import UserError

KINDS = ("param", "exp_avg", "exp_avg_sq")
SHARD_FORMAT = "toolkit-zero-shard"


def shard_file_name(rank: int, world_size: int) -> str:
    """zero-rank-00001-of-00004.safetensors."""
    return f"zero-rank-{rank:05d}-of-{world_size:05d}.safetensors"


def write_shard(path: Path, pieces, shapes: dict[str, tuple[int, ...]]) -> None:
    """Write this rank's pieces: [(name, start, stop, {kind: 1-D tensor})] as fp32 CPU tensors."""
    from safetensors.torch import save_file

    tensors, ranges = {}, {}
    for name, start, stop, views in pieces:
        ranges[name] = [start, stop]
        for kind in KINDS:
            tensors[f"{kind}/{name}"] = views[kind].detach().to("cpu", torch.float32).contiguous()
    used = {name: list(shapes[name]) for name in ranges}
    save_file(tensors, str(path), metadata={"format": SHARD_FORMAT, "ranges": json.dumps(ranges),
                                            "shapes": json.dumps(used)})


class ShardFilesReader:
    """Ranges of per-parameter fp32 tensors, assembled from the shard files of any world size."""

    def __init__(self, directory: Path, files: list[str], step: int):
        self.directory, self.step = Path(directory), int(step)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._pieces: dict[str, list[tuple[int, int, str]]] = {}
        self._stack = contextlib.ExitStack()
        self._handles = {}
        try:
            for name in files:
                self._open(name)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, name: str) -> None:
        """Open one shard file and read its metadata (ranges and shapes), each checked; one line if bad."""
        from safetensors import SafetensorError, safe_open

        path = self.directory / name
        if not path.is_file():
            raise UserError(f"{path}: missing ZeRO shard file (the checkpoint is incomplete)")
        try:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{path}: not a readable ZeRO shard file: {str(exc).splitlines()[0]}") from None
        meta = handle.metadata() or {}
        if meta.get("format") != SHARD_FORMAT:
            raise UserError(f"{path}: not a toolkit ZeRO shard file")
        try:
            shapes, ranges = json.loads(meta["shapes"]), json.loads(meta["ranges"])
            shapes = {p: tuple(int(d) for d in shape) for p, shape in shapes.items()}
            ranges = {p: (int(a), int(b)) for p, (a, b) in ranges.items()}
            if any(p not in shapes or not 0 <= a <= b <= torch.Size(shapes[p]).numel() for p, (a, b) in ranges.items()):
                raise ValueError("a range outside its parameter")
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            raise UserError(f"{path}: the shard's ranges/shapes metadata is malformed ({exc})") from None
        self._handles[name] = handle
        self.shapes.update(shapes)
        for pname, (start, stop) in ranges.items():
            self._pieces.setdefault(pname, []).append((start, stop, name))

    def names(self) -> list[str]:
        """Parameter names the shards hold."""
        return list(self.shapes)

    def read(self, kind: str, name: str, start: int, stop: int) -> torch.Tensor:
        """fp32 elements [start, stop) of flattened parameter `name` (kind: param, exp_avg, exp_avg_sq)."""
        if name not in self._pieces:
            raise UserError(f"{self.directory}: the ZeRO shards have no parameter {name!r} "
                            "(a checkpoint of another model)")
        out = torch.empty(stop - start, dtype=torch.float32)
        covered = 0
        for a, b, file in self._pieces[name]:
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                out[lo - start:hi - start] = self._slice(file, f"{kind}/{name}", lo - a, hi - a)
                covered += hi - lo
        if covered != stop - start:
            raise UserError(f"{self.directory}: the ZeRO shards cover {covered} of elements [{start}, {stop}) "
                            f"of {name!r} (shard files missing)")
        return out

    def _slice(self, file: str, key: str, start: int, stop: int) -> torch.Tensor:
        from safetensors import SafetensorError

        try:
            piece = self._handles[file].get_slice(key)[start:stop]
        except (SafetensorError, RuntimeError, ValueError, TypeError) as exc:
            raise UserError(f"{self.directory / file}: cannot read {key!r}: {str(exc).splitlines()[0]}") from None
        if piece.dim() != 1 or piece.numel() != stop - start:
            raise UserError(f"{self.directory / file}: {key!r} does not match the shard's ranges metadata")
        return piece

    def full(self, kind: str, name: str) -> torch.Tensor:
        """A whole parameter (or moment) in its shape."""
        shape = self.shapes[name]
        return self.read(kind, name, 0, int(torch.Size(shape).numel())).view(shape)

    def close(self) -> None:
        """Close the shard files."""
        self._stack.close()


class FullStateReader:
    """The same ranges served from an unsharded checkpoint: a model state dict and a torch AdamW state dict."""

    def __init__(self, model_state: dict, optimizer_state: dict | None, ordered_names: list[str]):
        self.model_state = model_state
        state = (optimizer_state or {}).get("state", {})
        # torch keys the state by the parameter's index in param_groups order (toolkit.runtime.optim.param_groups)
        self.moments = {name: state[i] for i, name in enumerate(ordered_names) if i in state}
        steps = [float(s["step"]) for s in self.moments.values() if "step" in s]
        self.step = int(steps[0]) if steps else 0

    def read(self, kind: str, name: str, start: int, stop: int) -> torch.Tensor:
        """fp32 elements [start, stop) of flattened parameter `name`."""
        if kind == "param":
            source = self.model_state[name]
        elif name in self.moments and kind == "exp_avg" and "momentum_buffer" in self.moments[name]:
            source = self.moments[name]["momentum_buffer"]  # torch.optim.Muon's state (optimizer.type muon)
        elif name in self.moments and kind in self.moments[name]:
            source = self.moments[name][kind]
        else:  # saved before the first optimizer step: moments are zero
            return torch.zeros(stop - start, dtype=torch.float32)
        return source.detach().reshape(-1)[start:stop].to("cpu", torch.float32)

    def close(self) -> None:
        """Nothing to close."""


def parameter_aliases(model: torch.nn.Module) -> dict[str, str]:
    """state_dict names that are another parameter (tied weights: lm_head.weight -> transformer.wte.weight)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def consolidated_model_state(engine_state: dict, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model state dict (fp32) of a ZeRO checkpoint: shards + buffers + tied aliases."""
    zero = engine_state["zero"]
    reader = ShardFilesReader(checkpoint_dir, zero["files"], zero["step"])
    try:
        state = {name: reader.full("param", name).clone() for name in reader.names()}
    finally:
        reader.close()
    state.update(engine_state.get("buffers") or {})
    for alias, name in zero.get("aliases", {}).items():
        state[alias] = state[name]
    return state
