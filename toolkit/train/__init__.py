"""train: a whole run of a recipe.

loop.py is `toolkit.run`: data, engine, evaluation, logging and checkpoint
cadence; startup_table.py is the table a run prints at start; preflight.py
makes every check that can refuse a run before anything slow; run_dir.py claims and checks the run directory; stop.py turns
SIGTERM/SIGINT into a checkpoint and a resume line; launch.py starts the
ranks of `toolkit run --nproc N`; dry_run.py builds one rank of an N-rank
job on torch's fake process group and checks it against the estimate
(`toolkit estimate --dry-run`); tune.py runs `toolkit tune`'s trials (each a
`toolkit run` process) and tune_report.py writes its tuned recipe, trial table and plot.

May import: every layer below (toolkit.runtime and what it stands on).
"""
