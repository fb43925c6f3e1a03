"""What a checkpoint holds, as values: nested training state flattened into a JSON
skeleton plus a flat {key: tensor} dict (and back), and the random generators'
states. Nothing here touches files; writing and reading them is
toolkit/checkpoint/io.py.
"""
from __future__ import annotations

import random
import sys

import numpy as np
import torch


# ---------------------------------------------------------------------------
# Flattening: nested state <-> (JSON skeleton, flat dict of tensors)

_TENSOR, _TUPLE, _ITEMS, _NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
_MARKERS = (_TENSOR, _TUPLE, _ITEMS, _NDARRAY)


def flatten_state(state) -> tuple[object, dict[str, torch.Tensor]]:
    """Nested dicts/lists/tuples of tensors and plain values -> a JSON-able skeleton and {key: tensor}.

    Tensors are keyed by their path ("engine.optimizer.state.0.exp_avg"). Dicts with
    non-string keys (optimizer state is keyed by int) and tuples are tagged so that
    `unflatten_state` gives back exactly the same types.
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def store(tensor: torch.Tensor, path: str) -> dict:
        t = tensor.detach().cpu()
        storage = t.untyped_storage()
        whole = (t.is_contiguous() and t.storage_offset() == 0
                 and t.numel() * t.element_size() == storage.nbytes())
        # NOTE: safetensors refuses tensors that share memory (GPT-2's lm_head is wte) and
        # views into a larger storage; those are copied, everything else is written as is.
        if not whole or storage.data_ptr() in storages:
            t = t.contiguous().clone()
        storages.add(t.untyped_storage().data_ptr())
        key, n = path or "tensor", 1
        while key in tensors:  # a dict key with dots could collide with a nested path
            key, n = f"{path}#{n}", n + 1
        tensors[key] = t
        return {_TENSOR: key}

    def walk(node, path: str):
        if isinstance(node, torch.Tensor):
            return store(node, path)
        if isinstance(node, dict):
            plain = all(isinstance(k, str) for k in node) and not (len(node) == 1 and next(iter(node)) in _MARKERS)
            if plain:
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in node.items()}
            for k in node:
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise TypeError(f"checkpoint state at {path or '<root>'}: dict key {k!r} is not a JSON scalar")
            return {_ITEMS: [[k, walk(v, f"{path}.{k}")] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
        if isinstance(node, np.ndarray):
            return {_NDARRAY: {"dtype": str(node.dtype), "shape": list(node.shape), "data": node.ravel().tolist()}}
        if isinstance(node, np.generic):
            return node.item()
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"checkpoint state at {path or '<root>'}: cannot store a {type(node).__name__} "
                        "(tensors, numbers, strings, lists and dicts only; nothing is pickled)")

    return walk(state, ""), tensors


def unflatten_state(skeleton, tensors: dict[str, torch.Tensor]):
    """Inverse of `flatten_state`. A tensor key missing from `tensors` raises KeyError(key); a malformed
    skeleton (a hand-edited state.json) raises ValueError naming the place, as `state.a.b: what`."""
    def build(node, path: str):
        if isinstance(node, list):
            return [build(v, f"{path}.{i}") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (tag, value), = node.items()
            if tag == _TENSOR:
                if not isinstance(value, str):
                    raise ValueError(f"{path}: {_TENSOR} holds {type(value).__name__}, expected a tensor key")
                if value not in tensors:
                    raise KeyError(value)
                return tensors[value]
            if tag == _TUPLE:
                if not isinstance(value, list):
                    raise ValueError(f"{path}: {_TUPLE} holds {type(value).__name__}, expected a list")
                return tuple(build(v, f"{path}.{i}") for i, v in enumerate(value))
            if tag == _ITEMS:
                scalar = (str, int, float, type(None))
                if not isinstance(value, list) or not all(
                        isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], scalar) for kv in value):
                    raise ValueError(f"{path}: {_ITEMS} must be a list of [scalar key, value] pairs")
                return {k: build(v, f"{path}.{k}") for k, v in value}
            if tag == _NDARRAY:
                try:
                    return np.array(value["data"], dtype=value["dtype"]).reshape(value["shape"])
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{path}: not an array ({_NDARRAY} needs data, dtype and shape): "
                                     f"{type(exc).__name__}: {exc}") from None
        return {k: build(v, f"{path}.{k}") for k, v in node.items()}

    return build(skeleton, "state")


# ---------------------------------------------------------------------------
# Random number generators

def capture_rng_state() -> dict:
    """Every generator training may draw from: python `random`, numpy, torch CPU, CUDA when present."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(legacy=False),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng_state(state: dict) -> str | None:
    """Why `state` (from a checkpoint) cannot be restored, or None: each part is tried on a scratch generator."""
    trials = {"python": lambda v: random.Random().setstate(v),
              "numpy": lambda v: np.random.RandomState().set_state(v),
              "torch": lambda v: torch.Generator().set_state(v)}
    for name, trial in trials.items():
        try:
            trial(state[name])
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as exc:
            return f"rng.{name}: not a generator state ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    cuda = state.get("cuda")
    if cuda is not None and not (isinstance(cuda, list) and all(isinstance(t, torch.Tensor) for t in cuda)):
        return "rng.cuda: not a list of CUDA generator states"
    return None


def restore_rng_state(state: dict) -> None:
    """Put back what `capture_rng_state` saw."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    saved_cuda = state.get("cuda")
    if saved_cuda is not None and torch.cuda.is_available():
        if len(saved_cuda) != torch.cuda.device_count():
            print(f"warning: resume: the checkpoint has CUDA generator states for {len(saved_cuda)} devices, "
                  f"this machine has {torch.cuda.device_count()}; restoring the first "
                  f"{min(len(saved_cuda), torch.cuda.device_count())}", file=sys.stderr)
        for device, rng in enumerate(saved_cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(rng, device)

