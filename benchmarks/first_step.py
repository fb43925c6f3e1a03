"""Command to first optimizer step: run one `toolkit run` command and time its output as it arrives.

Issue 33's start-up goal is read from the user's side: the seconds from the command to the first
`step 1/N` line (the run needs `training.log_interval=1`), kernel preparation included. Each output
line is echoed with its arrival time; the summary row gives the first step, the end, and the steady
tokens/s between the step-10 and last step lines (tokens per step from the run's own `batch` line).

    python -m benchmarks.first_step --label cold --markdown first_step.md -- \\
        python -m toolkit run recipes/gpt2-124m.json training.max_steps=40 training.log_interval=1
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

STEP = re.compile(r"^step\s+(\d+)/(\d+) \| loss")
TOKENS_PER_STEP = re.compile(r"([\d,]+) tokens per step")
HEADER = ("| run | first step s | end s | steady tokens/s (steps 10..last) | toolkit's last tok/s | exit |\n"
          "| --- | --- | --- | --- | --- | --- |\n")


def time_command(cmd: list[str]) -> dict:
    """Run `cmd`, echo its lines with their arrival times, and return the marks."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    marks: dict = {"steps": {}, "tokens_per_step": None, "last_rate": None}
    for line in proc.stdout:
        now = time.perf_counter() - start
        sys.stdout.write(f"[{now:7.2f}s] {line}")
        if (found := TOKENS_PER_STEP.search(line)) and marks["tokens_per_step"] is None:
            marks["tokens_per_step"] = int(found.group(1).replace(",", ""))
        if found := STEP.match(line):
            marks["steps"][int(found.group(1))] = now
            rate = re.search(r"\|\s+([\d.]+)k tok/s", line)
            marks["last_rate"] = float(rate.group(1)) * 1e3 if rate else marks["last_rate"]
    marks["rc"] = proc.wait()
    marks["end"] = time.perf_counter() - start
    return marks


def row(label: str, marks: dict) -> str:
    steps = marks["steps"]
    first = f"{steps[min(steps)]:.1f}" if steps else "-"
    steady = "-"
    if 10 in steps and max(steps) > 10 and marks["tokens_per_step"]:
        last = max(steps)
        steady = f"{(last - 10) * marks['tokens_per_step'] / (steps[last] - steps[10]):,.0f}"
    last_rate = f"{marks['last_rate']:,.0f}" if marks["last_rate"] else "-"
    return f"| {label} | {first} | {marks['end']:.1f} | {steady} | {last_rate} | {marks['rc']} |\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="the row's name (cold, cached, ...)")
    parser.add_argument("--markdown", type=Path, help="append the row here (the header when the file is new)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command after --")
    marks = time_command(cmd)
    line = row(args.label, marks)
    print(HEADER + line, end="")
    if args.markdown:
        new = not args.markdown.exists()
        with args.markdown.open("a") as out:
            out.write((HEADER if new else "") + line)
    return marks["rc"]


if __name__ == "__main__":
    sys.exit(main())
