"""Spec assembly: a schema-valid recipe dict (defaults filled in) becomes the frozen, typed `Recipe`, one spec
per section (toolkit/specs.py). Every spec is built here, with the checks that come with building it: the
batch triple (DeepSpeed style), the model's shape (presets, pretrained folders), the data section (keys read
per kind, paths with ${variables}, tokenizer vocabulary) and recipe.parallel (tensor and pipeline parallelism
against the world size, the model's shape and the ZeRO stage). Each builder returns (spec or None, error lines).

The data-parallel size is world / (tensor x pipeline); the batch triple is resolved over it, so
batch.world_size means data-parallel ranks. What does not live here: reading files and `extends`
(files.py), overrides (overrides.py), the schema (schema.py), the checks that build nothing (checks.py).
Torch-free.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from toolkit.errors import UserError
from toolkit.models.presets import SHAPES
from toolkit.recipe.checks import (cross_section_errors, pipeline_batch_errors, recipe_warnings, steps_per_epoch,
                                   training_max_steps)
from toolkit.recipe.schema import RecipeError, exclusive_keys, load_schema, matching_branches, section_defaults
from toolkit.specs import (BatchSpec, CheckpointSpec, CommunicationSpec, DataSpec, KernelsSpec, LoggingSpec,
                           LossScaleSpec, ModelSpec, OptimizerSpec, ParallelSpec, PrecisionSpec, Recipe, SchedulerSpec,
                           TrainingSpec, WandbSpec, ZeroSpec)

# Keys that name or describe a recipe without changing what it trains: outside the hash.
_NOT_HASHED = ("name", "description")


def assemble_recipe(r: dict, given: dict, *, source: Path | None, world_size: int,
                    default_name: str = "recipe") -> Recipe:
    """The typed `Recipe` of a schema-valid recipe: `r` with the defaults filled in (paths anchored), `given` as
    written; raises RecipeError with every problem the specs and the cross-section checks find."""
    recipe_dir = source.parent if source is not None else None
    data, errors = data_spec(r["data"], given["data"], recipe_dir)
    model, model_errors = model_spec(r["model"], given["model"], r["data"], data.vocab_size if data else 2, recipe_dir)
    # recipe.parallel: the batch triple is over the data-parallel ranks, world / (tensor x pipeline)
    parallel, dp_world, parallel_errors = parallel_spec(r["parallel"], r["zero"], model, world_size)
    batch, batch_errors = resolve_batch(r["batch"], dp_world)
    errors += model_errors + batch_errors + parallel_errors + pipeline_batch_errors(parallel, batch)
    max_steps, warnings = 0, []
    if batch is not None:
        max_steps, step_errors = training_max_steps(r["training"], r["data"], batch)
        errors += step_errors + cross_section_errors(r, given, batch, max_steps)
        warnings = recipe_warnings(r, given, max_steps)
    if errors:
        raise RecipeError(*errors)
    if model.pretrained is not None:  # the folder's config.json says what the model is, not these defaults
        for key in ("family", "size"):
            if key not in given["model"]:
                del r["model"][key]

    r["name"] = name = r.get("name") or default_name
    canonical = json.dumps({k: v for k, v in r.items() if k not in _NOT_HASHED}, sort_keys=True, separators=(",", ":"))
    p, s, t, lg = r["precision"], r["scheduler"], r["training"], r["logging"]
    return Recipe(
        name=name,
        description=r.get("description", ""),
        source=source,
        resolved=r,
        hash=hashlib.sha256(canonical.encode()).hexdigest()[:12],
        model=model,
        data=data,
        batch=batch,
        precision=PrecisionSpec(dtype=p["dtype"], fp16=LossScaleSpec(**p["fp16"])),
        zero=ZeroSpec(**r["zero"]),
        optimizer=OptimizerSpec(**{**r["optimizer"], "betas": tuple(r["optimizer"]["betas"])}),
        # NOTE: absent from the resolved recipe, these two follow optimizer.lr and the run's length (schema).
        scheduler=SchedulerSpec(**{**s, "total_num_steps": s.get("total_num_steps", max_steps),
                                   "warmup_max_lr": s.get("warmup_max_lr", r["optimizer"]["lr"])}),
        training=TrainingSpec(max_steps=max_steps, **{k: v for k, v in t.items() if k not in ("max_steps", "epochs")},
                              steps_per_epoch=steps_per_epoch(r["data"], batch) if "epochs" in t else None),
        logging=LoggingSpec(console=lg["console"], tensorboard=lg["tensorboard"],
                            wandb=WandbSpec(run_name=lg["wandb"].get("run_name"),
                                            **{k: v for k, v in lg["wandb"].items() if k != "run_name"})),
        checkpoint=CheckpointSpec(**r["checkpoint"]),
        kernels=KernelsSpec(**r["kernels"]),
        warnings=tuple(warnings),
        communication=CommunicationSpec(**r.get("communication", {})),
        parallel=parallel,
    )


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
                 if k in given and given[k] != section_defaults(model_schema).get(k)]
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


def parallel_spec(parallel: dict, zero: dict, model: ModelSpec | None, world: int
                  ) -> tuple[ParallelSpec, int, list[str]]:
    """(spec, data-parallel size, errors) for recipe.parallel at `world` processes."""
    spec = ParallelSpec(**parallel)
    tp, pp = spec.tensor, spec.pipeline
    if not spec.active:
        return spec, world, []
    errors = []
    if world % spec.model_ranks:
        errors.append(f"recipe.parallel: tensor {tp} x pipeline {pp} = {spec.model_ranks} ranks per model replica "
                      f"do not divide the world size {world}; launch a multiple of {spec.model_ranks} processes "
                      f"(--nproc, torchrun) or pass --world-size")
    if pp > 1 and zero["stage"] >= 2:
        errors.append(f"recipe.zero.stage: {zero['stage']} with parallel.pipeline {pp}: gradients and parameters "
                      "partitioned across data-parallel ranks do not fit the pipeline's micro-batch schedule (DeepSpeed "
                      "refuses it too); use zero.stage 0 or 1")
    elif zero["stage"] >= 2:
        errors.append(f"recipe.zero.stage: {zero['stage']} with parallel tensor {tp}: the data-parallel dimension of a "
                      "mesh shards optimizer states (stage 1) but not gradients or parameters; use zero.stage 0 or 1")
    if zero["offload_optimizer"] != "none":
        errors.append(f"recipe.zero.offload_optimizer: {zero['offload_optimizer']!r} with parallel tensor {tp} / "
                      f"pipeline {pp}: a mesh steps its optimizer on the device; set it to 'none'")
    if model is not None:
        errors += _model_errors(spec, model)
    return spec, max(world // spec.model_ranks, 1), errors


def _model_errors(spec: ParallelSpec, model: ModelSpec) -> list[str]:
    """The model's shape against the split: heads and MLP width by tensor, layers by pipeline stages."""
    if model.pretrained is not None:
        return ["recipe.parallel: tensor/pipeline parallelism splits the gpt2 and llama families the recipe builds, "
                f"not a pretrained folder ({model.pretrained}); set parallel.tensor and parallel.pipeline to 1"]
    errors = []
    tp, pp = spec.tensor, spec.pipeline
    width = model.intermediate_size or 4 * model.n_embd
    for key, value in (("n_head", model.n_head), ("n_kv_head", model.n_kv_head if model.family == "llama" else
                                                    model.n_head), ("intermediate_size", width)):
        if value % tp:
            errors.append(f"recipe.model.{key}: {value} is not divisible by parallel.tensor {tp} (each tensor-parallel "
                          "rank holds an equal part)")
    stages = pp * (2 if spec.pipeline_schedule == "interleaved_1f1b" else 1)
    if pp > 1 and model.n_layer % stages:
        errors.append(f"recipe.model.n_layer: {model.n_layer} layers do not split into {stages} equal pipeline stages "
                      f"(parallel.pipeline {pp}, schedule {spec.pipeline_schedule})")
    return errors
