"""DeepSpeed config -> recipe (`toolkit convert`, and `toolkit.initialize(ds_config_dict, model=...)`).

Reads the file as DeepSpeed does (deepspeed/runtime/config.py loads it with hjson and refuses duplicate keys):
JSON with `//`, `#` and `/* */` comments and trailing commas, a repeated key an error. The sections are
mapped by sections.py; here they become a recipe: standalone (`--model FAMILY/SIZE`, synthetic
data) or one that `extends` a base recipe (`--recipe BASE`, only the converted keys), validated like any
recipe. What the config says that the recipe does not carry is reported, one line per key; `strict`
makes that an error. Torch-free.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError
from toolkit.recipe.deepspeed.sections import BATCH, Conversion, convert_sections, settle_fp16_auto
from toolkit.recipe.files import deep_merge, find_recipe_file, load_with_extends
from toolkit.recipe.load import build_recipe
from toolkit.regular_files import regular_file_problem
from toolkit.specs import Recipe

# Keys only a DeepSpeed config has (a recipe has none of them): how `initialize` tells the two apart.
DEEPSPEED_ONLY_KEYS = frozenset({*BATCH, "zero_optimization", "fp16", "bf16", "bfloat16", "gradient_clipping",
                                 "steps_per_print", "amp", "activation_checkpointing", "tensorboard", "csv_monitor",
                                 "wall_clock_breakdown", "zero_allow_untested_optimizer"})
RECIPE_ONLY_KEYS = frozenset({"model", "data", "batch", "training", "precision", "zero"})
DEFAULT_MODEL = "gpt2/tiny"
DEFAULT_STEPS = 1000  # a DeepSpeed config does not say how long to train
DEFAULT_MICRO_BATCH = 8  # nor, when its batch keys are all "auto", how big a batch is


@dataclass(frozen=True)
class ConvertedRecipe:
    """A converted config: the recipe to write, the recipe it resolves to, and the report lines."""
    written: dict
    recipe: Recipe
    report: list[str]
    dropped: list[str]


def _strip_comments(text: str) -> str:
    """`//`, `#` and `/* */` comments blanked (newlines kept, so JSON errors keep their line), strings untouched."""
    out, i, n, in_string = [], 0, len(text), False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif ch == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                line = text.count("\n", 0, i) + 1
                raise UserError(f"line {line}: unterminated /* comment")
            out.append("".join(c if c == "\n" else " " for c in text[i:end + 2]))
            i = end + 2
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _drop_trailing_commas(text: str) -> str:
    """`[1, 2,]` and `{"a": 1,}` read as hjson reads them; commas inside strings untouched."""
    out, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            in_string = True
        elif ch == "," and text[i + 1:].lstrip()[:1] in ("}", "]"):
            out.append(" ")
            continue
        out.append(ch)
    return "".join(out)


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:  # as deepspeed/runtime/config_utils.py dict_raise_error_on_duplicate_keys
        raise UserError(f"duplicate keys in DeepSpeed config: {repeated}")
    return dict(pairs)


def parse_deepspeed_json(text: str) -> dict:
    """A DeepSpeed config's text (JSON with comments and trailing commas) -> dict; UserError lines say where."""
    try:
        data = json.loads(_drop_trailing_commas(_strip_comments(text)), object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise UserError(f"line {exc.lineno} column {exc.colno}: malformed JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise UserError("expected a JSON object (a DeepSpeed config)")
    return data


def read_deepspeed_config(path: str | os.PathLike) -> dict:
    """Read a DeepSpeed config file as DeepSpeed does; every problem one line naming the file."""
    problem = regular_file_problem(Path(path))
    if problem is not None:
        raise UserError(f"{path}: {problem}")
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
        return parse_deepspeed_json(text)
    except UserError as exc:
        raise UserError(*(f"{path}: {line}" for line in exc.lines)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None


def is_deepspeed_config(config: dict) -> bool:
    """Whether a dict is a DeepSpeed config rather than a recipe (by the keys only one of them has)."""
    if RECIPE_ONLY_KEYS & config.keys():
        return False
    with_params = any(isinstance(config.get(k), dict) and "params" in config[k] for k in ("optimizer", "scheduler"))
    return bool(DEEPSPEED_ONLY_KEYS & config.keys()) or with_params


def _model_section(model: str) -> dict:
    family, sep, size = model.partition("/")
    if not sep or not family or not size:
        raise UserError(f"--model {model}: expected FAMILY/SIZE, e.g. gpt2/124m or llama/1b")
    return {"family": family, "size": size}


def _derived_batch(given: dict, world_size: int) -> dict:
    """DeepSpeed's _set_batch_related_parameters on the recipe's names (all three filled)."""
    from toolkit.recipe.assemble import resolve_batch

    spec, errors = resolve_batch(given, world_size)
    if errors:
        raise UserError(*errors)
    return {"micro_batch_per_rank": spec.micro_batch_per_rank, "grad_accum_steps": spec.grad_accum_steps,
            "global_batch": spec.global_batch}


def _fill_base_batch(c: Conversion, base_batch: dict, world_size: int) -> None:
    """Batch keys the base sets and the config does not: DeepSpeed's derived values (else they would mix)."""
    given = c.recipe.get("batch", {})
    missing = [k for k in base_batch if k not in given]
    if not given or not missing:
        return
    derived = _derived_batch(given, world_size)
    for key in missing:
        given[key] = derived[key]
        c.notes.append(f"batch.{key}: {derived[key]}, derived as DeepSpeed does at world size {world_size} (the base "
                       "recipe sets it, the DeepSpeed config does not; at another world size, change it)")


def _lookup(resolved: dict, path: str):
    node = resolved
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _precision_dtype(raw: dict) -> str:
    """precision.dtype of a recipe dict not yet validated: its own, else the schema's default."""
    from toolkit.recipe.schema import load_schema

    return _lookup(raw, "precision.dtype") or load_schema()["properties"]["precision"]["properties"]["dtype"]["default"]


def _run_length_warnings(recipe: Recipe, from_steps_per_print: bool) -> list[str]:
    """A log interval the run never reaches (DeepSpeed's steps_per_print sized for a longer run): one step line."""
    interval, steps = recipe.training.log_interval, recipe.training.max_steps
    if not from_steps_per_print or steps is None or steps <= 1 or interval < steps:
        return []
    return [f"training.log_interval {interval} (steps_per_print) is not below training.max_steps {steps}: the run "
            f"writes one step line, its last; set training.log_interval to {max(1, steps // 20)} or less"]


def convert_deepspeed(ds: dict, *, model: str | None = None, base: str | os.PathLike | None = None,
                      out: str | os.PathLike | None = None, world_size: int | None = 1,
                      source: str = "DeepSpeed config",
                      strict: bool = False) -> ConvertedRecipe:
    """A DeepSpeed config dict -> the recipe to write (standalone, or `extends` base), validated, and the report."""
    if model is not None and base is not None:
        raise UserError("--model and --recipe exclude each other: the base recipe names its model")
    c = convert_sections(ds)
    out_dir = Path(out).absolute().parent if out is not None else Path.cwd()
    if base is not None:
        base_path = find_recipe_file(base).absolute()
        base_raw = load_with_extends(base_path)
    settle_fp16_auto(c, _precision_dtype(deep_merge(base_raw if base is not None else {}, c.recipe)))
    if base is not None:
        _fill_base_batch(c, base_raw.get("batch", {}), world_size or 1)
        written = {"extends": os.path.relpath(base_path, out_dir),
                   "description": f"{base_raw.get('description', base_path.name).rstrip('.')}; settings from {source}", **c.recipe}
        merged, recipe_source = deep_merge(base_raw, c.recipe), base_path
    else:
        sch = c.recipe.get("scheduler", {})
        steps = sch.get("total_num_steps") if isinstance(sch.get("total_num_steps"), int) else None
        c.notes.append(f"training.max_steps: {steps or DEFAULT_STEPS} ("
                       + ("the scheduler's total_num_steps" if steps else "a DeepSpeed config does not say how long "
                          "to train: set it") + "); data: synthetic tokens (a DeepSpeed config names no data)")
        if "batch" not in c.recipe:  # all "auto" (a Hugging Face Trainer config): its trainer sized the batch
            c.notes.append(f"batch.micro_batch_per_rank: {DEFAULT_MICRO_BATCH} (the config leaves the batch to its "
                           "trainer: set it)")
            c.recipe["batch"] = {"micro_batch_per_rank": DEFAULT_MICRO_BATCH}
        written = deep_merge({"description": f"converted from {source}", "model": _model_section(model or DEFAULT_MODEL),
                              "data": {"kind": "synthetic"}, "training": {"max_steps": steps or DEFAULT_STEPS}},
                             c.recipe)
        merged, recipe_source = written, None
    recipe = build_recipe(merged, source=recipe_source, world_size=world_size, default_name="converted")
    for ds_key, path in c.auto:
        section, _, key = path.partition(".")
        # NOTE: batch and scheduler values may be derived (batch triple, warmup_max_lr, total_num_steps): the spec has them.
        value = (getattr(getattr(recipe, section), key) if section in ("batch", "scheduler")
                 else _lookup(recipe.resolved, path))
        c.notes.append(f"{ds_key}: \"auto\" -> {path} = {json.dumps(value)} (the recipe's value)")
    report = [*(f"carried: {line}" for line in c.carried), *(f"note: {line}" for line in c.notes),
              *(f"warning: {line}" for line in _run_length_warnings(recipe, "steps_per_print" in ds)), *c.dropped]
    if strict and c.dropped:
        raise UserError(*(f"{source}: {line} (--strict)" for line in c.dropped))
    return ConvertedRecipe(written=written, recipe=recipe, report=report, dropped=list(c.dropped))


def recipe_from_deepspeed(ds: dict) -> Recipe:
    """`toolkit.initialize(ds_config_dict, model=...)`: the dict converted as `toolkit convert` does (world size from
    the launcher); each key not carried over and each "auto" is said once, as a warning."""
    from toolkit.errors import warn_once

    done = convert_deepspeed(ds, world_size=None, source="DeepSpeed config dict")
    for line in done.report:
        # NOTE: the run's length (training.max_steps, and the log interval against it) is the caller's own loop's
        if not line.startswith(("carried:", "note: training.max_steps", "warning: training.log_interval")):
            warn_once(f"DeepSpeed config: {line.removeprefix('note: ')}")
    return done.recipe
