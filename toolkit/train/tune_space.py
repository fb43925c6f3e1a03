"""The points of `toolkit tune`'s search space: the axes a search may take (TuneSpace), one candidate and what
running it gave (Trial), and a candidate's changes as the recipe keys a trial's run sets. toolkit/train/tune.py
searches them; tune_report.py writes the chosen one."""
from __future__ import annotations

import json
from dataclasses import dataclass

# NOTE: the "kernels off" candidate turns off the fused model ops; the AdamW stays as the recipe has it
# (optimizer.implementation decides it; kernels.adamw is deprecated).
KERNELS = ("layernorm", "rmsnorm", "bias_gelu", "cross_entropy")


@dataclass(frozen=True)
class TuneSpace:
    """The values each axis may take; None: the default for the recipe and device (tune.py's docstring)."""
    stages: tuple[int, ...] | None = None
    micro_batches: tuple[int, ...] | None = None
    checkpointing: tuple[bool, ...] = (False, True)
    offloads: tuple[str, ...] = ("none", "cpu", "cpu@0.5")
    refine: bool | None = None  # compile / kernels toggles on the best; None: on a GPU only


@dataclass
class Trial:
    """One candidate: what it changes, what the estimator predicted, and what running it gave (or why not)."""
    changes: dict
    predicted_bytes: int = 0
    status: str = "pending"  # ok, rerun (an A/B rerun that ran), failed, pruned, skipped, not run (budget)
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    reserved_bytes: int | None = None  # the CUDA allocator's reserved peak (None on the CPU)
    wall_s: float = 0.0
    why: str = ""
    baseline: bool = False  # the recipe as written (trial 0 and its reruns)
    rerun_of: int | None = None  # index of the trial an A/B rerun repeats

    @property
    def label(self) -> str:
        """The changes in a few words (`stage 2, micro 16, ckpt, offload cpu`)."""
        c = self.changes
        words = [f"stage {c['zero.stage']}", f"micro {c['batch.micro_batch_per_rank']}"]
        words += ["ckpt"] if c.get("model.activation_checkpointing") else []
        words += [f"offload {c['offload']}"] if c.get("offload", "none") != "none" else []
        words += ["overlapped"] if c.get("zero.offload_update") == "overlapped" else []
        words += ["compile"] if c.get("training.compile") else []
        words += ["kernels off"] if c.get("kernels") == "off" else []
        return ", ".join(words)


def _offload_keys(offload: str) -> dict:
    """`none`, `cpu` (ratio 1) or `cpu@0.5` as recipe keys. An offloading candidate keeps the recipe's
    zero.offload_update: the tuner runs the delayed update only where the recipe allows its staleness."""
    if offload == "none":  # NOTE: delayed needs offload, so a recipe that allows it is exact without offload
        return {"zero.offload_optimizer": "none", "zero.offload_update": "exact"}
    device, _, ratio = offload.partition("@")
    return {"zero.offload_optimizer": device, "zero.offload_ratio": float(ratio or 1)}


def changes_as_keys(changes: dict) -> dict:
    """A candidate's changes as recipe keys (offload and kernels expand to several)."""
    out = {k: v for k, v in changes.items() if k not in ("offload", "kernels")}
    out.update(_offload_keys(changes.get("offload", "none")))
    if "kernels" in changes:
        out.update({f"kernels.{k}": changes["kernels"] for k in KERNELS})
    return out


def override_args(changes: dict | None) -> list[str]:
    """A candidate's changes as `key=value` arguments; none for None (the recipe as written, untouched)."""
    if changes is None:
        return []
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in changes_as_keys(changes).items()]


def trial_overrides(trial: Trial) -> list[str]:
    """`key=value` arguments for a trial's run; none for the baseline (the recipe as written, untouched)."""
    return override_args(None if trial.baseline else trial.changes)


def original_changes(recipe) -> dict:
    """The original recipe's point in the space (what the candidates' changes are compared with)."""
    z = recipe.zero
    offload = "none" if z.offload_optimizer == "none" else (
        z.offload_optimizer if z.offload_ratio == 1 else f"{z.offload_optimizer}@{z.offload_ratio:g}")
    return {"zero.stage": z.stage, "batch.micro_batch_per_rank": recipe.batch.micro_batch_per_rank,
            "batch.grad_accum_steps": recipe.batch.grad_accum_steps,
            "model.activation_checkpointing": recipe.model.activation_checkpointing, "offload": offload,
            "training.compile": recipe.training.compile}
