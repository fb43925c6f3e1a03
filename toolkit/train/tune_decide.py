"""Whether `toolkit tune`'s best candidate really beats the recipe as written: the A/B/A/B re-measurement and the
rule that decides it. No processes here: tune.py hands in the function that runs one trial.

The re-measurement: the baseline (A, the recipe as written) and the best candidate (B) run again, interleaved
A, B, A, B (AB_PAIRS pairs), each in a fresh process, so that a drift of the machine (a neighbour's load, clocks,
the page cache) touches both alike. Only these reruns decide, not the search trials (those ran at other times),
except when the budget leaves room for one pair only (a slow baseline): then the search trials of the two join
the reruns as their second samples, A, B (search), then A, B (reruns).

The rule: the candidate wins when its slowest rerun is faster than the baseline's fastest rerun by more than
MIN_GAIN (1%):

    min(B reruns) > max(A reruns) x (1 + MIN_GAIN)

so the two ranges do not overlap: the gain exceeds the measured spread. The spread reported is the larger of the
two sides' ranges, (max - min) / mean; the speedup is mean(B) / mean(A). NOTE: MIN_GAIN because two or three
reruns underestimate the noise, and a change under 1% is not worth a different recipe. Otherwise the answer is
"keep your recipe" and no recipe is written. A candidate with a failed rerun is not reliable: keep. A baseline
whose every rerun failed loses to a candidate whose reruns all ran.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import mean
from typing import Callable

AB_PAIRS = 2  # A/B/A/B
MIN_GAIN = 0.01


@dataclass(frozen=True)
class Decision:
    """The answer: change the recipe to `candidate` (its label) or keep it, with the numbers behind it."""
    change: bool
    candidate: str = ""  # the best candidate's label; "" when the baseline itself was best or nothing else ran
    baseline_runs: tuple[float, ...] = ()  # tokens/s of the A/B reruns that ran
    candidate_runs: tuple[float, ...] = ()
    why: str = ""  # one line: why the answer is what it is
    reruns: tuple[int, ...] = ()  # trial indices of the reruns, in the order run
    with_search: bool = False  # the search trials' samples are among the runs (one pair only: the budget)
    untried: bool = False  # no candidate was measured: the budget ran out after the baseline (not a verdict)

    @property
    def speedup(self) -> float | None:
        """mean(candidate reruns) / mean(baseline reruns)."""
        if not (self.baseline_runs and self.candidate_runs):
            return None
        return mean(self.candidate_runs) / mean(self.baseline_runs)

    @property
    def spread(self) -> float | None:
        """The larger of the two sides' relative ranges, (max - min) / mean."""
        sides = [s for s in (self.baseline_runs, self.candidate_runs) if s]
        return max((max(s) - min(s)) / mean(s) for s in sides) if sides else None

    @property
    def worst_case(self) -> float | None:
        """The candidate's slowest rerun over the baseline's fastest (> 1 + MIN_GAIN to win)."""
        if not (self.baseline_runs and self.candidate_runs):
            return None
        return min(self.candidate_runs) / max(self.baseline_runs)


def decide(candidate: str, baseline_runs: list[float | None], candidate_runs: list[float | None],
           min_gain: float = MIN_GAIN) -> Decision:
    """Apply the rule (module docstring) to the reruns' tokens/s (None: that rerun failed)."""
    base = tuple(t for t in baseline_runs if t)
    cand = tuple(t for t in candidate_runs if t)
    if len(cand) < len(candidate_runs) or not cand:
        return Decision(False, candidate, base, cand, "the candidate failed a rerun: not reliable")
    if not base:
        return Decision(True, candidate, base, cand, "the recipe as written failed its reruns")
    worst = min(cand) / max(base)
    if worst > 1 + min_gain:
        return Decision(True, candidate, base, cand,
                        f"its slowest rerun is {worst:.3f}x the baseline's fastest (> {1 + min_gain:.2f} needed)")
    return Decision(False, candidate, base, cand,
                    f"its slowest rerun is {worst:.3f}x the baseline's fastest (<= {1 + min_gain:.2f}): "
                    "within the spread")


def measure_ab(run: Callable[[bool], tuple[int, float | None]], candidate: str, pairs: int = AB_PAIRS,
               earlier: tuple[list, list] = ([], [])) -> Decision:
    """Run A (baseline, run(True)) and B (candidate, run(False)) interleaved `pairs` times, then decide; `run`
    returns (its trial index, tokens/s or None). `earlier`: (baseline, candidate) samples measured before, from
    the search, which the rule takes with the reruns when the budget allowed one pair only. NOTE: that can only
    make the rule stricter: it compares the candidate's slowest sample with the baseline's fastest."""
    reruns, sides = [], {True: list(earlier[0]), False: list(earlier[1])}
    for _ in range(pairs):
        for is_baseline in (True, False):
            index, tokens_per_s = run(is_baseline)
            reruns.append(index)
            sides[is_baseline].append(tokens_per_s)
    return replace(decide(candidate, sides[True], sides[False]), reruns=tuple(reruns),
                   with_search=bool(earlier[0] or earlier[1]))
