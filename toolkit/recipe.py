"""Recipe loading: JSON file -> `extends` -> CLI overrides -> schema validation ->
defaults -> semantic checks -> a frozen, typed `Recipe` with one spec per section.

Every problem is reported as one line naming its JSON path (`recipe.zero.stage:
4 is not one of [0, 1, 2, 3]`), and all problems are collected before raising.
No torch here: `toolkit validate` must answer in well under a second.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.presets import SHAPES
from toolkit.resources import schema_path, shipped_dir
from toolkit.specs import (BatchSpec, CheckpointSpec, DataSpec, KernelsSpec, LoggingSpec, LossScaleSpec, ModelSpec,
                           OptimizerSpec, PrecisionSpec, Recipe, SchedulerSpec, TrainingSpec, WandbSpec, ZeroSpec)


class RecipeError(UserError):
    """The recipe is invalid; one line per problem."""


# ---------------------------------------------------------------------------
# Loading: files, extends, overrides.


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The recipe JSON Schema (the contract)."""
    return json.loads(schema_path().read_text())


def find_recipe_file(name_or_path: str | os.PathLike) -> Path:
    """A recipe path, or the name of a shipped recipe (`quickstart`, `recipes/quickstart.json`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    stem = path.name[:-5] if path.name.endswith(".json") else path.name
    shipped = shipped_dir("recipes") / f"{stem}.json"
    if path.parent in (Path("."), Path("recipes")) and shipped.is_file():
        return shipped
    if path.is_dir():
        raise RecipeError(f"{path}: is a directory, expected a recipe JSON file")
    raise RecipeError(f"{path}: recipe file not found (shipped recipes: `toolkit recipes`)")


class _JsonObject(dict):
    """A parsed JSON object that remembers the keys it saw more than once."""
    duplicates: list


def _object_keeping_duplicates(pairs) -> _JsonObject:
    obj = _JsonObject(pairs)
    seen: set = set()
    obj.duplicates = [k for k, _ in pairs if k in seen or seen.add(k)]
    return obj


def _duplicate_key_errors(node, parts=()) -> list[str]:
    """Each key given twice in one object; json.loads would silently keep the last."""
    errors = []
    if isinstance(node, _JsonObject):
        errors += [f"{_json_path([*parts, k])}: duplicate key (the last one would win)" for k in node.duplicates]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        errors += _duplicate_key_errors(value, (*parts, key))
    return errors


def _plain(node):
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


def _read_json_object(path: Path) -> dict:
    try:
        # NOTE: utf-8-sig also reads files that an editor saved with a byte-order mark.
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise RecipeError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read: {exc}") from None
    if not text.strip():
        raise RecipeError(f"{path}: empty file, expected a JSON object")
    try:
        data = json.loads(text, object_pairs_hook=_object_keeping_duplicates)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a JSON object at the top level, got {_json_type(data)}")
    duplicates = _duplicate_key_errors(data)
    if duplicates:
        raise RecipeError(*(f"{path}: {line}" for line in duplicates))
    return _plain(data)


def deep_merge(base: dict, child: dict) -> dict:
    """Child over base: objects merge key by key, everything else (lists too) replaces."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _load_with_extends(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(p.name for p in (*chain, path))
        raise RecipeError(f"{chain[-1]}: recipe.extends: cycle {cycle}")
    data = _read_json_object(path)
    data.pop("$schema", None)
    base_ref = data.pop("extends", None)
    if base_ref is None:
        return data
    if not isinstance(base_ref, str):
        raise RecipeError(f"{path}: recipe.extends: {base_ref!r} is not a path string")
    base_path = path.parent / base_ref
    if not base_path.is_file():
        raise RecipeError(f"{path}: recipe.extends: {base_ref}: file not found (looked at {base_path})")
    return deep_merge(_load_with_extends(base_path, (*chain, path)), data)


def _did_you_mean(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f" (expected one of: {', '.join(sorted(known))})"


def _parse_override_value(raw: str, node: dict) -> Any:
    """The override's text as the JSON type the schema wants there; raises ValueError naming that type."""
    kinds = node.get("type")
    if kinds is None and "enum" in node:
        kinds = sorted({_json_type(v) for v in node["enum"]})
    kinds = [kinds] if isinstance(kinds, str) else (kinds or ["string"])
    if kinds == ["string"]:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if "string" in kinds:
            return raw
        raise ValueError(" or ".join(_TYPE_NAMES.get(k, k) for k in kinds)) from None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if value is None:
        return "null"
    return "string"


def _override_target(keys: list[str]) -> tuple[dict | None, str | None]:
    """The schema node at `keys`, or None and a one-line reason naming the first key that is wrong."""
    node = load_schema()
    for depth, key in enumerate(keys):
        where = _json_path(keys[:depth + 1])
        if node.get("type") != "object" or "properties" not in node:
            return None, f"{_json_path(keys[:depth])}: is not an object, so it has no key '{key}'"
        known = node["properties"]
        if key not in known:
            reason = "empty key" if not key else f"unknown key{_did_you_mean(key, known)}"
            return None, f"{where}: {reason}"
        node = known[key]
    return node, None


def apply_overrides(recipe: dict, overrides: list[str]) -> dict:
    """Apply `key.path=value` overrides, each typed by the schema; errors name `recipe.key.path`."""
    recipe = json.loads(json.dumps(recipe))
    errors = []
    for item in overrides:
        dotted, sep, raw = item.partition("=")
        if not sep or not dotted:
            errors.append(f"override {item!r}: expected key.path=value (e.g. optimizer.lr=3e-4)")
            continue
        keys = dotted.split(".")
        if keys[0] in ("extends", "$schema"):
            errors.append(f"{_json_path(keys)}: cannot be overridden (override {item!r}); edit the recipe file")
            continue
        node, reason = _override_target(keys)
        if node is None:
            errors.append(f"{reason} (override {item!r})")
            continue
        try:
            value = _parse_override_value(raw, node)
        except ValueError as exc:
            errors.append(f"{_json_path(keys)}: {raw!r} is not {exc} (override {item!r})")
            continue
        target = recipe
        for depth, key in enumerate(keys[:-1]):
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                errors.append(f"{_json_path(keys[:depth + 1])}: is not an object in the recipe (override {item!r})")
                break
        else:
            target[keys[-1]] = value
    if errors:
        raise RecipeError(*errors)
    return recipe


# ---------------------------------------------------------------------------
# Validation.


def _json_path(parts) -> str:
    out = "recipe"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


_TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string",
               "boolean": "true or false", "object": "an object", "array": "a list"}


def _format_schema_error(error, recipe: dict) -> list[str]:
    where = _json_path(error.absolute_path)
    if error.validator == "additionalProperties":
        known = error.schema.get("properties", {}).keys()
        extras = [k for k in error.instance if k not in known]
        return [f"{_json_path([*error.absolute_path, k])}: unknown key{_did_you_mean(k, known)}" for k in extras]
    if error.validator == "required":
        missing = error.message.split("'")[1]
        why = f" ({error.schema['errorMessage']})" if "errorMessage" in error.schema else ""
        return [f"{_json_path([*error.absolute_path, missing])}: required, missing{why}"]
    if error.validator in ("anyOf", "oneOf") and "errorMessage" in error.schema:
        return [f"{where}: {error.schema['errorMessage']}"]
    if error.validator == "type":
        expected = error.validator_value
        expected = [expected] if isinstance(expected, str) else expected
        wanted = " or ".join(_TYPE_NAMES.get(t, t) for t in expected)
        return [f"{where}: {json.dumps(error.instance)} is not {wanted}"]
    if error.validator == "enum":
        hint = ""
        if isinstance(error.instance, str):
            strings = [v for v in error.validator_value if isinstance(v, str)]
            close = difflib.get_close_matches(error.instance, strings, n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
        if "then" in error.schema_path and list(error.absolute_path) == ["model", "size"]:
            hint = f" (sizes of family {recipe['model'].get('family', 'gpt2')}){hint}"
        return [f"{where}: {json.dumps(error.instance)} is not one of {json.dumps(error.validator_value)}{hint}"]
    return [f"{where}: {error.message}"]


def _non_finite_errors(node, parts=()) -> list[str]:
    """NaN and Infinity: Python's JSON reader accepts them and JSON Schema ranges do not catch NaN."""
    if isinstance(node, float) and not math.isfinite(node):
        return [f"{_json_path(parts)}: {json.dumps(node)} is not a finite number"]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [line for key, value in items for line in _non_finite_errors(value, (*parts, key))]


def _document_order(recipe: dict, parts) -> list[int]:
    """Where a JSON path sits in the recipe as written (key order), so errors read top to bottom."""
    order, node = [], recipe
    for part in parts:
        if isinstance(node, dict) and part in node:
            order.append(list(node).index(part))
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            order.append(part)
        else:
            order.append(len(node) if isinstance(node, (dict, list)) else 0)
            break
        node = node[part]
    return order


def _narrowest_enum_errors(errors: list) -> list:
    """model.size fails both the list of all sizes and its family's list: keep only the family's."""
    narrowest = {}
    for error in errors:
        if error.validator == "enum":
            key = tuple(error.absolute_path)
            if key not in narrowest or len(error.validator_value) < len(narrowest[key].validator_value):
                narrowest[key] = error
    return [e for e in errors if e.validator != "enum" or narrowest[tuple(e.absolute_path)] is e]


def schema_errors(recipe: dict) -> list[str]:
    """Every schema violation, one line each, in document order."""
    non_finite = _non_finite_errors(recipe)
    if non_finite:
        return non_finite
    # NOTE: jsonschema imports rfc3987_syntax when it is installed (jupyter brings it),
    # which spends ~1.6 s building a grammar; recipes use no `format`, so keep it out.
    sys.modules.setdefault("rfc3987_syntax", None)
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(load_schema())
    errors = _narrowest_enum_errors(list(validator.iter_errors(recipe)))
    lines = []
    for error in sorted(errors, key=lambda e: _document_order(recipe, e.absolute_path)):
        lines.extend(_format_schema_error(error, recipe))
    return lines


def _coerce_integers(node: dict, instance: Any) -> Any:
    """JSON Schema counts 4.0 as an integer; make it the int 4 wherever the schema wants an integer."""
    wants_int = node.get("type") == "integer" or (
        "enum" in node and all(_json_type(v) == "integer" for v in node["enum"]))
    if wants_int and isinstance(instance, float) and instance.is_integer():
        return int(instance)
    if isinstance(instance, dict):
        props = node.get("properties", {})
        return {k: _coerce_integers(props[k], v) if k in props else v for k, v in instance.items()}
    if isinstance(instance, list) and isinstance(node.get("items"), dict):
        return [_coerce_integers(node["items"], v) for v in instance]
    return instance


def _matching_branches(node: dict, instance: dict) -> list[dict]:
    """The `then` schemas of `allOf: [{if, then}]` whose `if` the instance satisfies."""
    from jsonschema import Draft202012Validator

    return [branch["then"] for branch in node.get("allOf", ())
            if "if" in branch and "then" in branch and Draft202012Validator(branch["if"]).is_valid(instance)]


def fill_defaults(node: dict, instance: dict) -> dict:
    """Fill every absent property that has a schema default; recurse into objects.

    Defaults inside `allOf: [{if, then}]` apply when the `if` holds once the plain defaults
    are in (data.kind synthetic fills vocab_size, kind jsonl fills field, ...).
    """
    out = dict(instance)
    for key, sub in node.get("properties", {}).items():
        if not isinstance(sub, dict):
            continue
        if key not in out and "default" in sub:
            out[key] = json.loads(json.dumps(sub["default"]))
        if sub.get("type") == "object" and "properties" in sub:
            out[key] = fill_defaults(sub, out.get(key, {}))
    for then in _matching_branches(node, out):
        for key, sub in then.get("properties", {}).items():
            if key not in out and isinstance(sub, dict) and "default" in sub:
                out[key] = json.loads(json.dumps(sub["default"]))
    return out


# ---------------------------------------------------------------------------
# Semantic checks (beyond what the schema can say) and spec building.


def resolve_batch(batch: dict, world_size: int) -> tuple[BatchSpec | None, list[str]]:
    """Derive the batch triple DeepSpeed style; errors show the arithmetic."""
    micro = batch.get("micro_batch_per_rank")
    accum = batch.get("grad_accum_steps")
    total = batch.get("global_batch")
    w = world_size
    if micro is not None and accum is not None and total is not None:
        if micro * accum * w != total:
            return None, [f"recipe.batch: global_batch {total} != micro_batch_per_rank {micro} * "
                          f"grad_accum_steps {accum} * world_size {w} = {micro * accum * w}"]
    elif micro is not None and total is not None:
        if total % (micro * w):
            return None, [f"recipe.batch: global_batch {total} is not divisible by micro_batch_per_rank {micro} "
                          f"* world_size {w} = {micro * w}"]
        accum = total // (micro * w)
    elif accum is not None and total is not None:
        if total % (accum * w):
            return None, [f"recipe.batch: global_batch {total} is not divisible by grad_accum_steps {accum} "
                          f"* world_size {w} = {accum * w}"]
        micro = total // (accum * w)
    elif total is not None:
        if total % w:
            return None, [f"recipe.batch: global_batch {total} is not divisible by world_size {w}"]
        accum, micro = 1, total // w
    else:
        accum = accum or 1
        total = micro * accum * w
    return BatchSpec(micro, accum, total, w), []


def _pretrained_vocab_errors(config_path: Path, vocab_size: int) -> list[str]:
    """A pretrained model must embed every id the data's tokenizer produces."""
    try:
        model_vocab = json.loads(config_path.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError):
        return []  # unreadable: models.py reports it when loading
    if isinstance(model_vocab, int) and model_vocab < vocab_size:
        return [f"recipe.model.pretrained: the model embeds {model_vocab} token ids, fewer than the data's "
                f"vocabulary of {vocab_size} (data.vocab_size or the tokenizer's)"]
    return []


def _model_spec(model: dict, given: dict, data: dict, vocab_size: int,
                recipe_dir: Path | None) -> tuple[ModelSpec | None, list[str]]:
    """`model` has the schema defaults filled in; `given` is the model section as written."""
    errors = []
    family = model["family"]
    explicit = ("n_layer", "n_embd", "n_head", "n_kv_head", "intermediate_size")
    if family == "gpt2":
        for key in ("n_kv_head", "intermediate_size"):
            if key in model:
                errors.append(f"recipe.model.{key}: only llama models have this key (family is gpt2)")
    pretrained = None
    if "pretrained" in model:
        clash = [k for k in ("size", *explicit) if k in given]
        if clash:
            errors.append(f"recipe.model.pretrained: excludes {', '.join(clash)} (the folder's config.json sets the shape)")
        pretrained = Path(model["pretrained"])
        if recipe_dir is not None and not pretrained.is_absolute():
            pretrained = recipe_dir / pretrained
        if not (pretrained / "config.json").is_file():
            errors.append(f"recipe.model.pretrained: {pretrained}: no config.json there")
        else:
            errors += _pretrained_vocab_errors(pretrained / "config.json", vocab_size)
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


def _data_spec(data: dict, given: dict, recipe_dir: Path | None) -> tuple[DataSpec | None, list[str]]:
    """`data` has the schema defaults filled in; `given` is the data section as written.

    Each key is read only under the conditions the schema's if/then branches name (kind
    synthetic reads branching, kind jsonl reads field, ...); a key given where nothing
    reads it is an error, never silently ignored. Paths get their ${variables} expanded
    and the files they name must exist (toolkit/corpus.py).
    """
    schema = load_schema()["properties"]["data"]
    branched = {k for then in (b.get("then", {}) for b in schema.get("allOf", ()))
                for k in (*then.get("properties", {}), *then.get("required", ()))}
    read = set(schema["properties"]) - branched
    for then in _matching_branches(schema, data):
        read.update(then.get("properties", {}), then.get("required", ()))
    errors = [f"recipe.data.{key}: not read with data.kind {data['kind']}"
              + (f" and data.tokenizer {data['tokenizer']}" if data["kind"] != "synthetic" else "")
              + f" (read when {'; or when '.join(_keys_read_elsewhere(schema, key))})"
              for key in given if key not in read]
    if errors:
        return None, errors
    kind, common = data["kind"], dict(kind=data["kind"], seq_len=data["seq_len"], seed=data["seed"])
    if kind == "synthetic":
        return DataSpec(**common, vocab_size=data["vocab_size"], branching=data["branching"],
                        num_samples=data["num_samples"], eval_samples=data["eval_samples"]), []

    from toolkit.corpus import expand_path, list_files
    from toolkit.tokenizer import BYTE_VOCAB_SIZE, MIN_BPE_VOCAB_SIZE, pretrained_vocab_size

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


def _training_steps(training: dict, data: dict, batch: BatchSpec) -> tuple[int, list[str]]:
    if "max_steps" in training:
        return int(training["max_steps"]), []
    if data["kind"] != "synthetic":
        return 0, [f"recipe.training.epochs: needs data.kind synthetic (a {data['kind']} corpus's sequence count is "
                   "known only once it is tokenized); give training.max_steps"]
    # An epoch is the whole global batches that fit (the stream drops the remainder).
    steps_per_epoch = data["num_samples"] // batch.global_batch
    return max(math.ceil(training["epochs"] * steps_per_epoch), 1), []


def _check_cross_section(r: dict, batch: BatchSpec, max_steps: int) -> list[str]:
    errors = []
    sched = r["scheduler"]
    if sched["type"] != "constant":
        if sched["warmup_num_steps"] >= max_steps:
            errors.append(f"recipe.scheduler.warmup_num_steps: {sched['warmup_num_steps']} is not shorter than the run "
                          f"({max_steps} optimizer steps)")
        total = sched.get("total_num_steps")
        if total is not None and total <= sched["warmup_num_steps"]:
            errors.append(f"recipe.scheduler.total_num_steps: {total} must exceed warmup_num_steps "
                          f"{sched['warmup_num_steps']}")
    if r["zero"]["offload_optimizer"] != "none" and r["zero"]["stage"] < 1:
        errors.append("recipe.zero.offload_optimizer: 'cpu' needs zero.stage >= 1 (stage is 0)")
    data, training = r["data"], r["training"]
    if data["kind"] != "synthetic":
        pass  # a real corpus's sizes are checked when it is read (toolkit/data.py)
    elif training["eval_batches"] > 0 and data["eval_samples"] < batch.micro_batch_per_rank:
        errors.append(f"recipe.data.eval_samples: {data['eval_samples']} is fewer than one micro batch "
                      f"({batch.micro_batch_per_rank}); add samples or set training.eval_batches to 0")
    if data["kind"] == "synthetic" and data["num_samples"] < batch.global_batch:
        errors.append(f"recipe.data.num_samples: {data['num_samples']} is fewer than one global batch "
                      f"({batch.global_batch})")
    if r["precision"]["dtype"] != "fp16" and "fp16" in r.get("_given_precision", {}):
        errors.append("recipe.precision.fp16: loss scaling applies only to precision.dtype 'fp16'")
    return errors


def _world_size(world_size: int | None) -> tuple[int, list[str]]:
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


def build_recipe(raw: dict, *, source: Path | None = None, world_size: int | None = None,
                 default_name: str = "recipe") -> Recipe:
    """Validate a merged recipe dict and build the typed `Recipe`; raises RecipeError with every problem."""
    world_size, errors = _world_size(world_size)
    errors += schema_errors(raw)
    if errors:
        raise RecipeError(*errors)
    raw = _coerce_integers(load_schema(), raw)
    r = fill_defaults(load_schema(), raw)
    r["_given_precision"] = raw.get("precision", {})
    recipe_dir = source.parent if source is not None else None
    data, errors = _data_spec(r["data"], raw["data"], recipe_dir)
    model, model_errors = _model_spec(r["model"], raw["model"], r["data"], data.vocab_size if data else 2, recipe_dir)
    batch, batch_errors = resolve_batch(r["batch"], world_size)
    errors += model_errors + batch_errors
    max_steps = 0
    if batch is not None:
        max_steps, step_errors = _training_steps(r["training"], r["data"], batch)
        errors += step_errors + _check_cross_section(r, batch, max_steps)
    del r["_given_precision"]
    if errors:
        raise RecipeError(*errors)

    name = r.get("name") or default_name
    canonical = json.dumps(r, sort_keys=True, separators=(",", ":"))
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
        scheduler=SchedulerSpec(**{**s, "total_num_steps": s.get("total_num_steps", max_steps)}),
        training=TrainingSpec(max_steps=max_steps, **{k: v for k, v in t.items() if k not in ("max_steps", "epochs")}),
        logging=LoggingSpec(console=lg["console"], tensorboard=lg["tensorboard"],
                            wandb=WandbSpec(run_name=lg["wandb"].get("run_name"),
                                            **{k: v for k, v in lg["wandb"].items() if k != "run_name"})),
        checkpoint=CheckpointSpec(**r["checkpoint"]),
        kernels=KernelsSpec(**r["kernels"]),
    )


def load_recipe(path_or_name: str | os.PathLike, overrides: list[str] | tuple = (), *,
                world_size: int | None = None) -> Recipe:
    """Load, extend, override, validate and type a recipe file (or a shipped recipe's name)."""
    path = find_recipe_file(path_or_name)
    raw = apply_overrides(_load_with_extends(path), list(overrides))
    default_name = path.name[:-5] if path.name.endswith(".json") else path.name
    return build_recipe(raw, source=path, world_size=world_size, default_name=default_name)


def recipe_from_dict(raw: dict, overrides: list[str] | tuple = (), *, world_size: int | None = None,
                     name: str = "recipe") -> Recipe:
    """Build a Recipe from a dict (the Python API and tests); same checks as a file."""
    raw = {k: v for k, v in raw.items() if k != "$schema"}
    if "extends" in raw:
        raise RecipeError("recipe.extends: only recipe files can extend (paths are relative to the file)")
    return build_recipe(apply_overrides(raw, list(overrides)), world_size=world_size, default_name=name)
