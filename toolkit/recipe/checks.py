"""Semantic checks beyond what the schema can say, and the section specs they build:
the batch triple, the model's shape (presets, pretrained folders), the data section
(keys read per kind, paths with ${variables}, tokenizer vocabulary), the step count,
cross-section rules and the world size. Each returns (spec or None, error lines).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from toolkit.errors import UserError
from toolkit.models.presets import SHAPES
from toolkit.recipe.schema import exclusive_keys, load_schema, matching_branches
from toolkit.specs import BatchSpec, DataSpec, ModelSpec


def _defaults(section_schema: dict) -> dict:
    """The schema's default of each key of a section that has one."""
    return {k: v["default"] for k, v in section_schema["properties"].items() if "default" in v}


def resolve_batch(batch: dict, world_size: int) -> tuple[BatchSpec | None, list[str]]:
    """Derive the batch triple DeepSpeed style; errors show the arithmetic and the keys that fix it."""
    micro = batch.get("micro_batch_per_rank")
    accum = batch.get("grad_accum_steps")
    total = batch.get("global_batch")
    w = world_size
    if micro is not None and accum is not None and total is not None:
        if micro * accum * w != total:
            keep = [f"batch.{key} to {total // (other * w)}" for key, other in
                    (("grad_accum_steps", micro), ("micro_batch_per_rank", accum)) if total % (other * w) == 0]
            return None, [f"recipe.batch: global_batch {total} != micro_batch_per_rank {micro} x grad_accum_steps "
                          f"{accum} x world size {w} = {micro * accum * w}; set "
                          + (f"{' or '.join(keep)} to keep the global batch, or " if keep else "")
                          + f"batch.global_batch to {micro * accum * w}"]
    elif micro is not None and total is not None:
        if total % (micro * w):
            return None, [f"recipe.batch: global_batch {total} is not divisible by micro_batch_per_rank {micro} x "
                          f"world size {w} = {micro * w}; set {_batch_fix(total, 'micro_batch_per_rank', micro, w)}"]
        accum = total // (micro * w)
    elif accum is not None and total is not None:
        if total % (accum * w):
            return None, [f"recipe.batch: global_batch {total} is not divisible by grad_accum_steps {accum} x "
                          f"world size {w} = {accum * w}; set {_batch_fix(total, 'grad_accum_steps', accum, w)}"]
        micro = total // (accum * w)
    elif total is not None:
        if total % w:
            return None, [f"recipe.batch: global_batch {total} is not divisible by world size {w}; set "
                          f"batch.global_batch to {_multiples_near(total, w)}"]
        accum, micro = 1, total // w
    else:
        accum = accum or 1
        total = micro * accum * w
    return BatchSpec(micro, accum, total, w), []


def _batch_fix(total: int, key: str, value: int, w: int) -> str:
    """The keys that make global_batch `total` divide into batch.`key` `value` x world size `w`: a smaller
    `key` that keeps the global batch (when the world size divides it), or a global batch near `total`."""
    keep = ""
    if total % w == 0:
        fits = max(d for d in range(1, min(value, total // w) + 1) if (total // w) % d == 0)
        keep = f"batch.{key} to {fits} to keep the global batch, or "
    return f"{keep}batch.global_batch to {_multiples_near(total, value * w)}"


def _multiples_near(n: int, step: int) -> str:
    """The multiples of `step` either side of `n`: `8 or 12` (only the upper one below `step`)."""
    below, above = n // step * step, (n // step + 1) * step
    return f"{below} or {above}" if below else str(above)


def _read_pretrained_config(config_path: Path) -> dict:
    """A pretrained folder's config.json; {} when unreadable (toolkit/models/build.py reports that when loading)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _pretrained_vocab_errors(config: dict, vocab_size: int) -> list[str]:
    """A pretrained model must embed every id the data's tokenizer produces."""
    model_vocab = config.get("vocab_size")
    if isinstance(model_vocab, int) and model_vocab < vocab_size:
        return [f"recipe.model.pretrained: the model embeds {model_vocab} token ids, fewer than the data's "
                f"vocabulary of {vocab_size} (data.vocab_size or the tokenizer's)"]
    return []


def model_spec(model: dict, given: dict, data: dict, vocab_size: int,
               recipe_dir: Path | None) -> tuple[ModelSpec | None, list[str]]:
    """The model's shape from its size preset, explicit keys or pretrained folder, and the errors found.

    `model` has the schema defaults filled in; `given` is the model section as written."""
    errors = []
    family = model["family"]
    explicit = ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate_size")
    if family == "gpt2":
        for key in ("n_kv_head", "intermediate_size"):
            if key in model:
                errors.append(f"recipe.model.{key}: only llama models have this key (family is gpt2)")
    pretrained = pretrained_type = None
    if "pretrained" in model:
        # NOTE: the default size, written out (a run's own recipe.json has it), is not a clash.
        model_schema = load_schema()["properties"]["model"]
        clash = [k for k in exclusive_keys(model_schema)["pretrained"]
                 if k in given and given[k] != _defaults(model_schema).get(k)]
        if clash:
            errors.append(f"recipe.model.pretrained: excludes {', '.join(clash)} (the folder's config.json sets the shape)")
        pretrained = Path(model["pretrained"])
        if recipe_dir is not None and not pretrained.is_absolute():
            pretrained = recipe_dir / pretrained
        try:
            has_config = (pretrained / "config.json").is_file()
        except OSError as exc:  # a name too long for the file system
            errors.append(f"recipe.model.pretrained: cannot read: {exc.strerror}")
            has_config = None
        if has_config is False:
            errors.append(f"recipe.model.pretrained: {pretrained}: no config.json there")
        else:
            config = _read_pretrained_config(pretrained / "config.json")
            pretrained_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
            errors += _pretrained_vocab_errors(config, vocab_size)
    shape = {"n_kv_head": None, "intermediate_size": None, **SHAPES[family][model["size"]]}
    shape.update({k: model[k] for k in explicit if k in model})
    n_kv_head = shape["n_kv_head"] or shape["n_head"]
    if shape["n_embd"] % shape["n_head"]:
        errors.append(f"recipe.model: n_embd {shape['n_embd']} is not divisible by n_head {shape['n_head']}")
    if shape["n_head"] % n_kv_head:
        errors.append(f"recipe.model: n_head {shape['n_head']} is not divisible by n_kv_head {n_kv_head}")
    max_positions = model.get("max_positions", data["seq_len"])
    if max_positions < data["seq_len"]:
        errors.append(f"recipe.model.max_positions: {max_positions} is shorter than data.seq_len {data['seq_len']}")
    if errors:
        return None, errors
    return ModelSpec(
        family=family, size=model["size"], n_layer=shape["n_layer"], n_embd=shape["n_embd"],
        n_head=shape["n_head"], n_kv_head=n_kv_head,
        intermediate_size=shape["intermediate_size"] or 4 * shape["n_embd"],
        max_positions=max_positions, vocab_size=vocab_size, pretrained=pretrained,
        dropout=float(model["dropout"]), activation_checkpointing=model["activation_checkpointing"],
        pretrained_type=pretrained_type,
        reshaped=tuple(k for k in explicit if k in model and model[k] != SHAPES[family][model["size"]].get(k)),
    ), []


def _keys_read_elsewhere(data_schema: dict, key: str) -> list[str]:
    """The conditions under which the data section reads `key` (from the schema's if/then branches)."""
    conditions = []
    for branch in data_schema.get("allOf", ()):
        then = branch.get("then", {})
        if key in then.get("properties", {}) or key in then.get("required", ()):
            parts = [f"data.{k} {'/'.join(v['enum']) if 'enum' in v else v['const']}"
                     for k, v in branch["if"]["properties"].items()]
            conditions.append(" and ".join(parts))
    return conditions


def data_spec(data: dict, given: dict, recipe_dir: Path | None) -> tuple[DataSpec | None, list[str]]:
    """The data section as a DataSpec (paths expanded, files listed, vocabulary known), and the errors found.

    `data` has the schema defaults filled in; `given` is the data section as written.

    Each key is read only under the conditions the schema's if/then branches name (kind
    synthetic reads branching, kind jsonl reads field, ...); a key given where nothing
    reads it is an error, never silently ignored. Paths get their ${variables} expanded
    and the files they name must exist (toolkit/data/paths.py).
    """
    schema = load_schema()["properties"]["data"]
    branched = {k for then in (b.get("then", {}) for b in schema.get("allOf", ()))
                for k in (*then.get("properties", {}), *then.get("required", ()))}
    read = set(schema["properties"]) - branched
    for then in matching_branches(schema, data):
        read.update(then.get("properties", {}), then.get("required", ()))
    errors = [f"recipe.data.{key}: not read with data.kind {data['kind']}"
              + (f" and data.tokenizer {data['tokenizer']}" if data["kind"] != "synthetic" else "")
              + f" (read when {'; or when '.join(_keys_read_elsewhere(schema, key))})"
              for key in given if key not in read]
    if errors:
        return None, errors
    kind, common = data["kind"], dict(kind=data["kind"], seq_len=data["seq_len"], seed=data["seed"])
    if kind == "synthetic":
        if data["branching"] > data["vocab_size"]:
            return None, [f"recipe.data.branching: {data['branching']} exceeds data.vocab_size {data['vocab_size']} "
                          "(each token's successors are drawn from the vocabulary)"]
        return DataSpec(**common, vocab_size=data["vocab_size"], branching=data["branching"],
                        num_samples=data["num_samples"], eval_samples=data["eval_samples"]), []

    from toolkit.data.paths import expand_path, list_files
    from toolkit.data.tokenizer import BYTE_VOCAB_SIZE, MIN_BPE_VOCAB_SIZE, pretrained_vocab_size

    try:
        paths = tuple(expand_path(p, f"recipe.data.paths[{i}]", recipe_dir) for i, p in enumerate(data["paths"]))
        exclude = tuple(data["exclude"])
        list_files(paths, exclude)
        cache_dir = Path(expand_path(data["cache_dir"], "recipe.data.cache_dir", recipe_dir))
        tokenizer_path = None
        if data["tokenizer"] == "byte":
            vocab_size = BYTE_VOCAB_SIZE
        elif data["tokenizer"] == "bpe":
            vocab_size = data["vocab_size"]
            if vocab_size < MIN_BPE_VOCAB_SIZE:
                return None, [f"recipe.data.vocab_size: {vocab_size} is below {MIN_BPE_VOCAB_SIZE}, the 256 bytes and "
                              "<|endoftext|> a byte-level BPE starts from plus one merge"]
        else:
            tokenizer_path = Path(expand_path(data["tokenizer_path"], "recipe.data.tokenizer_path", recipe_dir))
            vocab_size = pretrained_vocab_size(tokenizer_path, "recipe.data.tokenizer_path")
    except UserError as exc:
        return None, exc.lines
    return DataSpec(**common, vocab_size=vocab_size, paths=paths, exclude=exclude, field=data.get("field"),
                    column=data.get("column"), errors=data["errors"], tokenizer=data["tokenizer"],
                    tokenizer_path=tokenizer_path, validation_fraction=float(data["validation_fraction"]),
                    cache_dir=cache_dir), []


def training_max_steps(training: dict, data: dict, batch: BatchSpec) -> tuple[int, list[str]]:
    """The run's length in optimizer steps: training.max_steps, or training.epochs over synthetic data."""
    if "max_steps" in training:
        return int(training["max_steps"]), []
    if data["kind"] != "synthetic":
        return 0, [f"recipe.training.epochs: needs data.kind synthetic (a {data['kind']} corpus's sequence count is "
                   "known only once it is tokenized); give training.max_steps"]
    return max(math.ceil(training["epochs"] * steps_per_epoch(data, batch)), 1), []


def steps_per_epoch(data: dict, batch: BatchSpec) -> int:
    """Optimizer steps in one pass over synthetic data: the whole global batches that fit (the stream drops the rest)."""
    return data["num_samples"] // batch.global_batch


def cross_section_errors(r: dict, batch: BatchSpec, max_steps: int) -> list[str]:
    """The rules that join keys of different sections (scheduler, zero offload, data sizes, precision, device)."""
    errors = []
    sched = r["scheduler"]
    if sched["type"] != "constant":
        total = sched.get("total_num_steps")
        if total is not None and total <= sched["warmup_num_steps"]:
            errors.append(f"recipe.scheduler.total_num_steps: {total} must exceed warmup_num_steps "
                          f"{sched['warmup_num_steps']}")
    zero = r["zero"]
    if zero["offload_optimizer"] != "none" and zero["stage"] < 1:
        errors.append(f"recipe.zero.offload_optimizer: {zero['offload_optimizer']!r} needs zero.stage >= 1 (stage is 0)")
    if zero["offload_ratio"] != 1 and zero["offload_optimizer"] == "none":
        errors.append(f"recipe.zero.offload_ratio: {zero['offload_ratio']} needs zero.offload_optimizer "
                      "'cpu' (it is the part of the optimizer kept in CPU memory) or 'nvme' (in swap files)")
    if zero["nvme_ratio"] != 1 and zero["offload_optimizer"] != "nvme":
        errors.append(f"recipe.zero.nvme_ratio: {zero['nvme_ratio']} needs zero.offload_optimizer 'nvme' (it is the "
                      "part of the offloaded optimizer kept in swap files; the rest stays in CPU memory)")
    if zero["offload_param"] != "none" and zero["stage"] != 3:
        errors.append(f"recipe.zero.offload_param: {zero['offload_param']!r} needs zero.stage 3 (stage is "
                      f"{zero['stage']}; only stage 3 partitions the parameters)")
    nvme = [key for key in ("offload_optimizer", "offload_param") if zero[key] == "nvme"]
    if nvme and not zero["nvme_path"]:
        errors.append(f"recipe.zero.nvme_path: needed by zero.{nvme[0]} 'nvme' (a folder for the swap files)")
    mesh = r["parallel"]["tensor"] * r["parallel"]["pipeline"] > 1  # its DTensors reduce their own gradients
    if r["optimizer"]["type"] == "onebit_adam" and (r["zero"]["stage"] != 0 or r["precision"]["dtype"] == "fp16" or mesh):
        what = (f"zero.stage {r['zero']['stage']}" if r["zero"]["stage"] != 0 else "parallel.tensor/pipeline > 1"
                if mesh else "precision.dtype 'fp16'")
        errors.append(f"recipe.optimizer.type: 'onebit_adam' runs on zero.stage 0 in fp32 or bf16, not with {what} "
                      "(as DeepSpeed's 1-bit Adam, it replaces stage 0's gradient all-reduce); use 'adamw' there")
    data, training = r["data"], r["training"]
    if data["kind"] != "synthetic":
        pass  # a real corpus's sizes are checked when it is read (toolkit/data/batches.py)
    elif training["eval_batches"] > 0 and data["eval_samples"] < batch.micro_batch_per_rank:
        errors.append(f"recipe.data.eval_samples: {data['eval_samples']} is fewer than one micro batch "
                      f"({batch.micro_batch_per_rank}); add samples or set training.eval_batches to 0")
    if data["kind"] == "synthetic" and data["num_samples"] < batch.global_batch:
        errors.append(f"recipe.data.num_samples: {data['num_samples']} is fewer than one global batch "
                      f"({batch.global_batch})")
    if r["precision"]["dtype"] == "fp16" and training["device"] == "cpu":
        errors.append("recipe.precision.dtype: 'fp16' needs a CUDA device but training.device is 'cpu'; "
                      "use 'bf16' (or 'fp32') on a CPU")
    fp16_defaults = _defaults(load_schema()["properties"]["precision"]["properties"]["fp16"])
    changed = [k for k, v in r.get("_given_precision", {}).get("fp16", {}).items() if v != fp16_defaults.get(k)]
    if r["precision"]["dtype"] != "fp16" and changed:
        errors.append(f"recipe.precision.fp16.{changed[0]}: loss scaling applies only to precision.dtype 'fp16'")
    return errors


def recipe_warnings(r: dict, given: dict, max_steps: int) -> list[str]:
    """Choices that run but may not be what the user meant, one line each (`toolkit validate` and `run` print them).

    `r` has the schema defaults filled in; `given` is the recipe as written.
    """
    warnings = []
    sched, lr = r["scheduler"], r["optimizer"]["lr"]
    if sched["type"] != "constant" and sched["warmup_num_steps"] >= max_steps:
        # NOTE: DeepSpeed accepts this too; a short trial run of a shipped recipe is the usual cause.
        peak = sched.get("warmup_max_lr", lr) if sched["type"] != "WarmupCosineLR" else lr
        warnings.append(f"recipe.scheduler.warmup_num_steps: {sched['warmup_num_steps']} is not shorter than the run "
                        f"({max_steps} optimizer steps): the schedule is cut at the run's end, still warming up "
                        f"(the lr never reaches {peak:g})")
    if sched["type"] == "WarmupDecayLR" and "warmup_max_lr" not in given.get("scheduler", {}) \
            and sched["warmup_max_lr"] != lr:
        warnings.append(f"recipe.scheduler.warmup_max_lr: not given, so WarmupDecayLR warms up to "
                        f"{sched['warmup_max_lr']:g} (DeepSpeed's default), not optimizer.lr {lr:g}; set it")
    adamw = r["kernels"]["adamw"]
    if adamw != "auto":  # NOTE: kept for old recipes; toolkit/runtime/optim.py adamw_implementation reads it
        meaning = ("reads as optimizer.implementation 'torch_fused'" if adamw == "off" else
                   "still makes the toolkit's AdamW kernel required where optimizer.implementation takes it")
        warnings.append(f"recipe.kernels.adamw: deprecated, recipe.optimizer.implementation decides the AdamW; "
                        f"'{adamw}' {meaning}")
    return warnings


def gpu_driver_visible() -> bool:
    """True when this machine shows an NVIDIA or ROCm GPU driver: a cheap look that imports no torch."""
    return (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd")
            or shutil.which("nvidia-smi") is not None)


def fp16_device_warning(dtype: str, device: str) -> str | None:
    """`validate`'s warning for fp16 on 'auto' where no GPU driver shows (no torch import: a cheap look)."""
    if dtype != "fp16" or device != "auto" or gpu_driver_visible():
        return None
    return ("recipe.precision.dtype: 'fp16' needs a CUDA device and this machine shows no NVIDIA driver: "
            "`toolkit run` here refuses it (training.device 'auto' falls back to the CPU); use 'bf16' on a CPU")


def resolve_world_size(world_size: int | None) -> tuple[int, list[str]]:
    """The data-parallel world size: the argument, else $WORLD_SIZE (torchrun sets it), else 1."""
    if world_size is None:
        env = os.environ.get("WORLD_SIZE", "1")
        try:
            world_size = int(env)
        except ValueError:
            return 1, [f"WORLD_SIZE: {env!r} is not an integer"]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return 1, [f"world size: {world_size!r} must be a positive integer (--world-size N, WORLD_SIZE)"]
    return world_size, []
