"""`toolkit` command line. Thin: parse arguments, call the library, map user
mistakes (`UserError`) to one line each on stderr and exit code 2.

Start-up stays light: torch is imported only by the sub-commands that train.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from toolkit.errors import UserError, warn_once

EXIT_USER_ERROR = 2


def _load_recipe_and_warn(args, world_size: int | None = None, *, warn: bool = True):
    """The recipe the command names, with overrides; its warnings go to stderr as `warning: ...` lines, once per
    launch (`warn_once`: the --nproc launcher says them and its ranks do not repeat them)."""
    from toolkit.recipe.load import load_recipe

    recipe = load_recipe(args.recipe, args.overrides, world_size=world_size)
    for line in recipe.warnings if warn else ():
        warn_once(line)
    return recipe


def _cmd_validate(args) -> int:
    from toolkit.optional_packages import check_recipe_packages
    from toolkit.recipe.checks import fp16_device_warning
    from toolkit.train.preflight import machine_fit_warnings

    recipe = _load_recipe_and_warn(args, args.world_size)
    note = fp16_device_warning(recipe.precision.dtype, recipe.training.device)  # `run` refuses it on such a machine
    if note:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    for note in check_recipe_packages(recipe):
        print(f"note: {note}", file=sys.stderr)
    for line in machine_fit_warnings(recipe):  # valid, but this machine cannot hold it (exit code still 0)
        print(f"warning: {line}", file=sys.stderr, flush=True)
    b = recipe.batch
    print(f"{args.recipe}: valid (hash {recipe.hash}); {recipe.model.label}, "
          f"global batch {b.global_batch} = micro {b.micro_batch_per_rank} x accum {b.grad_accum_steps} "
          f"x world {b.world_size}, {recipe.training.max_steps} steps")
    return 0


def _cmd_estimate(args) -> int:
    recipe = _load_recipe_and_warn(args, args.world_size, warn=False)
    if args.dry_run:  # one rank of the N-rank job, built and measured (toolkit/train/dry_run.py)
        from toolkit.train.dry_run import dry_run_command

        return dry_run_command(recipe, rank=args.rank or 0, steps=3 if args.steps is None else args.steps)
    if args.rank is not None or args.steps is not None:
        raise UserError("estimate: --rank and --steps go with --dry-run")
    from toolkit.observe.estimate import find_device, format_estimate
    from toolkit.observe.estimate_input import EstimateInput
    from toolkit.observe.memory_fit import format_peak_summary
    from toolkit.observe.tiers import format_tier_estimate

    print(format_peak_summary(recipe, find_device(args.device) if args.device else None) + "\n")
    inp = EstimateInput.from_recipe(recipe)
    print(format_estimate(inp, device=args.device))
    print(format_tier_estimate(inp))
    if inp.parallel.active:  # the mesh's busiest rank (toolkit/observe/parallel_estimate.py)
        from toolkit.observe.parallel_estimate import format_parallel_estimate

        print(format_parallel_estimate(inp))
    return 0


def _cmd_run(args) -> int:
    if args.nproc is not None:  # this process launches the ranks; each runs `toolkit run` without --nproc
        from pathlib import Path

        if args.nproc < 1:
            raise UserError(f"--nproc {args.nproc}: must be at least 1")

        from toolkit.train.run_dir import default_run_dir
        from toolkit.train.launch import launch_ranks
        from toolkit.train.preflight import check_before_torch

        # user mistakes: one line, here; warnings too, once (the ranks inherit warn_once's record)
        recipe = _load_recipe_and_warn(args, args.nproc)
        run_dir = args.run_dir or str(default_run_dir(recipe))
        check_before_torch(recipe, run_dir)  # before the launcher makes the run dir and starts the ranks
        return launch_ranks(args.nproc, ["run", args.recipe, *args.overrides, "--run-dir", run_dir], Path(run_dir))
    from toolkit.train.stop import NOTES_ENV, RunStopped

    try:
        _run_this_process(args)
    except (UserError, RunStopped, RuntimeError) as exc:  # one line each (a bug keeps its traceback)
        if isinstance(exc, UserError) and not os.environ.get(NOTES_ENV):
            raise  # main() prints it; torch may not be loaded yet (the memory check runs before it)
        from toolkit.train.launch import end_rank

        return end_rank(exc)
    return 0


def _run_this_process(args) -> None:
    """`toolkit run` in one process, or one rank of `--nproc` / torchrun."""
    from toolkit.observe.memory_fit import allocation_failure, is_allocation_failure
    from toolkit.train.preflight import check_before_torch
    from toolkit.train.stop import LAUNCHER_PID_ENV

    if os.environ.get(LAUNCHER_PID_ENV):  # a rank of `--nproc`: ends with its launcher
        from toolkit.train.launch import die_with_launcher

        die_with_launcher()
    recipe = _load_recipe_and_warn(args)
    check_before_torch(recipe, args.run_dir)  # refuse what this machine cannot run in a second, before torch loads
    from toolkit.train.loop import run

    try:
        run(recipe, run_dir=args.run_dir)
    except (RuntimeError, MemoryError) as exc:  # the last resort: the pre-flight estimate is a lower bound
        if not is_allocation_failure(exc):
            raise
        raise allocation_failure(recipe, exc) from None


def _cmd_export(args) -> int:
    from toolkit.checkpoint.export import export_hf

    done = export_hf(args.run_dir, args.out_dir)
    print(f"exported {done.checkpoint} (step {done.step}, recipe hash {done.recipe_hash}) -> {done.out_dir}: "
          f"{', '.join(done.files)}")
    return 0


def _cmd_generate(args) -> int:
    from toolkit.checkpoint.generate import check_sampling_args, describe, generate_text, load_generator

    check_sampling_args(args.max_new_tokens, args.temperature, args.top_k)
    gen = load_generator(args.path, args.tokenizer)
    print(describe(gen), file=sys.stderr, flush=True)
    print(generate_text(gen, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0


def _cmd_schema(args) -> int:
    from toolkit.resources import schema_path

    print(schema_path().read_text(), end="")
    return 0


def _cmd_recipes(args) -> int:
    from toolkit.resources import shipped_dir

    for path in sorted(shipped_dir("recipes").glob("*.json")):
        description = json.loads(path.read_text()).get("description", "")
        print(f"{path.stem:<24} {description}")
    return 0


def _cmd_tutorials(args) -> int:
    from toolkit.optional_packages import check_command_packages
    from toolkit.cli.notebook_runner import execute_notebooks
    from toolkit.cli.tutorials import (BUILD_COMMAND, GPU_SUBDIR, TUTORIALS_DIR, build_all, build_index,
                                       notebook_name, record_run_time, template_paths)

    check_command_packages(BUILD_COMMAND)
    if (args.gpu or args.names) and not args.execute:
        raise UserError("tutorials build: --gpu and notebook names go with --execute")
    if args.execute:
        check_command_packages(f"{BUILD_COMMAND} --execute")
        unknown = sorted(set(args.names) - {notebook_name(t) for t in template_paths()})
        if unknown:
            raise UserError(f"tutorials build --execute: no notebook named {', '.join(unknown)} "
                            f"(the names are those of tutorials/templates/*.md.j2, e.g. 01_quickstart)")
    stale = build_all(check=True)
    if args.check:
        for path in stale:
            print(f"error: {path.relative_to(TUTORIALS_DIR.parent)}: stale, differs from its template; "
                  f"rebuild with `{BUILD_COMMAND}`", file=sys.stderr)
        if not stale:
            print("tutorials: every notebook matches its template")
        return EXIT_USER_ERROR if stale else 0
    built = build_all()
    for path in built:
        print(f"{path.relative_to(TUTORIALS_DIR.parent)}: {'updated' if path in stale else 'unchanged'}")
    if args.execute:
        chosen = [p for p in built if p.suffix == ".ipynb" and (p.parent.name == GPU_SUBDIR) == args.gpu
                  and (not args.names or p.stem in args.names)]
        if args.names:  # in the order given: a device call that may be cut short runs the sure ones first
            chosen.sort(key=lambda p: args.names.index(p.stem))
        failed = 0
        for path, seconds, error in execute_notebooks(chosen, root=TUTORIALS_DIR.parent):
            where = path.relative_to(TUTORIALS_DIR.parent)
            print(f"{where}: executed in {seconds:.1f} s" + (f"; FAILED: {error}" if error else ""), flush=True)
            failed += error is not None
            if error is None:
                record_run_time(path, seconds)
                build_index()  # its run times
        return 1 if failed else 0
    return 0


def version_line() -> str:
    """`toolkit X.Y.Z from <package folder> (python X.Y)`: which toolkit this is and where it was imported from."""
    import platform
    from pathlib import Path

    import toolkit

    return (f"toolkit {toolkit.__version__} from {Path(toolkit.__file__).parent} "
            f"(python {platform.python_version()})")


def _doctor_environment() -> list[str]:
    import platform

    import torch

    from toolkit import cuda_allocator
    from toolkit.cli.bytecode_cache import bytecode_lines

    lines = [f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            lines.append(f"cuda:{i} {torch.cuda.get_device_name(i)} (compute capability {major}.{minor})")
        lines.append(cuda_allocator.describe() + " (the toolkit command's default: expandable segments unless "
                     "PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set; docs/running.md)")
    else:
        lines.append("no CUDA device: training runs on the CPU")
    lines.extend(bytecode_lines())
    return lines


def _cmd_doctor(args) -> int:
    from toolkit.ops import loader
    from toolkit.cli.doctor import distributed_lines
    from toolkit.optional_packages import doctor_lines as optional_package_lines

    # NOTE: one (title, lines) section per component; add yours to this list.
    sections = [("environment", _doctor_environment()), ("distributed", distributed_lines()),
                ("kernels", loader.doctor_lines()),
                ("optional packages", optional_package_lines())]
    print(version_line())
    for title, lines in sections:
        print(f"{title}:")
        for line in lines:
            print(f"  {line}")
    return 0


def _cmd_build_kernels(args) -> int:
    from toolkit.ops import loader
    from toolkit.ops.toolchain import target_archs

    buildable = (*loader.KERNELS, "cpu_adam")
    names = args.kernels or list(loader.KERNELS)
    unknown = [n for n in names if n not in buildable]
    if unknown:
        raise UserError(f"build-kernels: unknown kernel {unknown[0]!r}; one of {', '.join(buildable)}")
    if any(n in loader.KERNELS for n in names):
        archs, notes = target_archs()
        print(f"building {', '.join(names)} for {', '.join(map(str, archs))} + PTX into {loader.cache_root()}",
              flush=True)
        for note in notes:
            print(f"note: {note}")
    else:
        print(f"building {', '.join(names)} into {loader.cache_root()}", flush=True)
    statuses = loader.build_all(names, verbose=args.verbose)
    for status in statuses:
        print(status.describe())
    failed = [s for s in statuses if not s.active]
    if len({(s.reason, s.fix) for s in failed}) == 1:  # one cause (no nvcc, CPU torch): one line
        raise UserError(f"kernels {', '.join(s.name for s in failed)}: {failed[0].reason}; fix: {failed[0].fix}")
    if failed:
        raise UserError(*(f"kernel {s.name}: {s.reason}; fix: {s.fix}" for s in failed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    # NOTE: the raw formatter keeps `--version`'s line whole (argparse wraps it at the terminal's width otherwise).
    parser = argparse.ArgumentParser(prog="toolkit", description="Declarative training recipes.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print the toolkit's version, where it is installed and the Python version")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check a recipe against the schema and its semantic rules")
    p.add_argument("recipe", help="recipe file, or the name of a shipped recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, typed by the schema")
    p.add_argument("--world-size", type=int, default=None, help="check the batch sizes for this many ranks")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("estimate", help="memory per rank for ZeRO stages 0-3 and offload, before running")
    p.add_argument("recipe", help="recipe file, or the name of a shipped recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, typed by the schema")
    p.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (default WORLD_SIZE or 1)")
    p.add_argument("--device", default=None, help="GPU to check the fit against, e.g. H100-80GB, A100-40GB, RTX4090")
    p.add_argument("--dry-run", action="store_true", help="build one rank of the --world-size N job on torch's fake "
                   "process group, train --steps steps, and check its memory and bytes on the wire against the estimate")
    p.add_argument("--rank", type=int, default=None, help="with --dry-run: the rank to build (default 0)")
    p.add_argument("--steps", type=int, default=None, help="with --dry-run: optimizer steps to take (default 3)")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("run", help="train from a recipe")
    p.add_argument("recipe", help="recipe file, or the name of a shipped recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, typed by the schema")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<name>-<timestamp>)")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="launch N data-parallel ranks on this machine (torch.distributed.run; one per GPU, "
                        "or CPU ranks over gloo); same as torchrun --nproc_per_node N -m toolkit run")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("export", help="write a run's latest checkpoint as a Hugging Face model folder")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory (its latest checkpoint), or a step-NNNNNN dir")
    p.add_argument("out_dir", metavar="OUT_DIR", help="new or empty folder for config.json and model.safetensors")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("generate", help="sample text from a run's latest checkpoint (or an exported folder)")
    p.add_argument("path", metavar="RUN_DIR", help="run directory (its latest checkpoint), a step-NNNNNN dir, "
                                                   "or an exported Hugging Face folder")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample at most (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: RUN_DIR/tokenizer, or the "
                                                     "exported folder itself)")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("doctor", help="environment and fused-kernel status (builds nothing)")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("build-kernels", help="build the fused CUDA kernels ahead of time (JIT cache)")
    p.add_argument("kernels", nargs="*", metavar="KERNEL", help="kernels (default: the CUDA ones), or cpu_adam")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.set_defaults(func=_cmd_build_kernels)

    from toolkit.cli import convert, tune

    convert.add_parser(sub)
    tune.add_parser(sub)

    p = sub.add_parser("schema", help="print the recipe JSON Schema")
    p.set_defaults(func=_cmd_schema)

    p = sub.add_parser("recipes", help="list the shipped recipes")
    p.set_defaults(func=_cmd_recipes)

    p = sub.add_parser("tutorials", help="tutorial notebooks generated from tutorials/templates/")
    tutorials = p.add_subparsers(dest="tutorials_command", required=True, metavar="ACTION")
    p = tutorials.add_parser("build", help="render every template to tutorials/<name>.ipynb")
    p.add_argument("--check", action="store_true", help="write nothing; exit 2 naming the stale notebooks")
    p.add_argument("--execute", action="store_true",
                   help="then run the CPU notebooks (with --gpu: the GPU ones) and save them with their outputs")
    p.add_argument("--gpu", action="store_true", help="with --execute: the GPU variants in tutorials/gpu/")
    p.add_argument("names", nargs="*", metavar="NAME", help="with --execute: only these notebooks (e.g. 01_quickstart)")
    p.set_defaults(func=_cmd_tutorials)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `toolkit` console script."""
    from toolkit.cli.bytecode_cache import use_bytecode_cache
    from toolkit.cuda_allocator import use_expandable_segments_by_default
    from toolkit.runtime.cpu_threads import set_openmp_wait_policy

    use_bytecode_cache()  # before any sub-command loads torch: its bytecode kept where the environment keeps none
    set_openmp_wait_policy()  # before any sub-command loads torch (and with it OpenMP)
    use_expandable_segments_by_default()  # before torch's CUDA allocator reads its settings (ranks inherit them)
    parser = build_parser()
    # Overrides may come after options (`run R --run-dir D a.b=1`): argparse leaves them over.
    args, rest = parser.parse_known_args(argv)
    if rest:
        if not hasattr(args, "overrides") or any(item.startswith("-") or "=" not in item for item in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides = [*args.overrides, *rest]
    try:
        return args.func(args)
    except UserError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
