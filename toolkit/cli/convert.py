"""The `toolkit convert` command: a DeepSpeed config -> a recipe, reporting every key not carried over.
Thin: parse, call toolkit/recipe/deepspeed/, print."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from toolkit.errors import UserError, failed_write


def write_file(path: Path, text: str) -> None:
    """Write an output file; a failed write is one line naming it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise UserError(failed_write(exc, path) or f"{path}: cannot write: {exc}") from None


def _cmd_convert(args) -> int:
    from toolkit.recipe.deepspeed import convert_deepspeed, read_deepspeed_config

    ds = read_deepspeed_config(args.ds_config)
    done = convert_deepspeed(ds, model=args.model, base=args.recipe, out=args.out, world_size=args.world_size,
                             source=Path(args.ds_config).name, strict=args.strict)
    for line in done.report:  # carried: / note: / warning: lines, then `key: not carried over: why`
        print(line, file=sys.stderr)
    text = json.dumps(done.written, indent=2) + "\n"
    b = done.recipe.batch
    carried = sum(line.startswith("carried:") for line in done.report)
    summary = (f"{carried} keys carried over, {len(done.dropped)} not; global batch {b.global_batch} = micro {b.micro_batch_per_rank} x accum {b.grad_accum_steps} x "
               f"world {b.world_size} (hash {done.recipe.hash})")
    if args.out is None:
        print(text, end="")
        print(summary, file=sys.stderr)
        return 0
    write_file(Path(args.out), text)
    print(f"wrote {args.out}: {summary}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    """The convert sub-command on `toolkit`'s parser."""
    p = sub.add_parser("convert", help="a DeepSpeed config (JSON, comments allowed) -> a recipe, reporting every key "
                                       "not carried over")
    p.add_argument("ds_config", metavar="DS_CONFIG", help="DeepSpeed config file (ds_config.json)")
    p.add_argument("--model", default=None, metavar="FAMILY/SIZE", help="model of a standalone recipe (default "
                                                                        "gpt2/tiny), e.g. gpt2/124m, llama/1b")
    p.add_argument("--recipe", default=None, metavar="BASE", help="write a recipe that extends BASE (its model, data, "
                                                                  "length) with the config's settings")
    p.add_argument("--out", default=None, metavar="FILE", help="write the recipe here (default: print it)")
    p.add_argument("--world-size", type=int, default=1, help="ranks to check the batch sizes for (default 1)")
    p.add_argument("--strict", action="store_true", help="a key not carried over is an error (exit 2)")
    p.set_defaults(func=_cmd_convert)
