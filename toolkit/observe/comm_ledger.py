"""Communication counters: what the engine's collectives sent and how long the step waited for them.

`CommLedger` is filled by the one place that issues the engine's collectives
(toolkit/runtime/communicator.py) and read by the loop once per optimizer step: bytes
sent by this rank per kind of collective, and the exposed time (seconds the
step spent blocked in a collective's wait() or in a synchronous collective:
communication that compute did not hide). `expected_step_bytes` is the ZeRO
paper's traffic formula the start-up table prints and the tests hold the
measured bytes to.

What "bytes sent per rank" means here (docs/communication.md): the ring
algorithm's traffic for a buffer of B bytes over n ranks. A reduce-scatter, an
all-gather and an all-to-all each send (n-1)/n x B per rank (B: the whole
buffer, not a rank's chunk); an all-reduce is a reduce-scatter plus an
all-gather, 2(n-1)/n x B; a broadcast (a pipelined chain) sends (n-1)/n x B per
rank on average. The backend may pick another algorithm (NCCL trees, gloo's
own): these are the logical bytes of the bandwidth-optimal schedule, the same
for every backend, so the figures compare across runs. One rank sends nothing.
"""
from __future__ import annotations

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def wire_bytes(kind: str, buffer_bytes: int, world: int) -> int:
    """Bytes one rank sends for a collective over a `buffer_bytes` buffer (the ring schedule; see above)."""
    if world <= 1:
        return 0
    factor = 2 if kind == "all_reduce" else 1
    # NOTE: integer arithmetic, so measured and expected bytes compare exactly; buffers are padded
    # to a multiple of the world size by the strategies (flat.py) so the division is exact there.
    return factor * (world - 1) * buffer_bytes // world


def expected_step_bytes(stage: int, numel: int, world: int, element_bytes: int, grad_accum_steps: int = 1,
                        root_numel: int = 0) -> dict[str, int]:
    """Bytes per rank per optimizer step of the model-state collectives, by kind (the ZeRO paper's formulas).

    Ψ = numel elements of element_bytes each: stage 0 all-reduces the gradients (2Ψ); stages 1-2
    reduce-scatter them and all-gather the new weights (Ψ + Ψ; stage 2 reduce-scatters every micro-step);
    stage 3 all-gathers every unit in forward and again in backward and reduce-scatters its gradient
    (3Ψ per micro-step), except its root unit (embeddings, head: `root_numel`), gathered once per
    micro-step for forward and backward together. Each Ψ is (n-1)/n of the buffer on the wire.
    """
    psi = numel * element_bytes
    accum = grad_accum_steps
    if stage == 0:
        kinds = {"all_reduce": wire_bytes("all_reduce", psi, world)}
    elif stage in (1, 2):
        reductions = accum if stage == 2 else 1
        kinds = {"reduce_scatter": reductions * wire_bytes("reduce_scatter", psi, world),
                 "all_gather": wire_bytes("all_gather", psi, world)}
    else:
        gathered = 2 * psi - root_numel * element_bytes
        kinds = {"reduce_scatter": accum * wire_bytes("reduce_scatter", psi, world),
                 "all_gather": accum * wire_bytes("all_gather", gathered, world)}
    return {k: v for k, v in kinds.items() if v}


def format_wire_bytes(n: float) -> str:
    """1.23 MB (decimal units, as link speeds are quoted)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


class CommLedger:
    """Bytes this rank sent (by kind) and seconds it was blocked on communication, per optimizer step.

    `sent` and `blocked` accumulate into the open step; `take_step()` closes it, adds it to `totals` and
    returns its figures; while `paused` (evaluation) collectives are not counted.
    """

    def __init__(self, simulated_link_gbps: float | None = None):
        self.simulated_link_gbps = simulated_link_gbps
        self.paused = False
        self._step = self._empty()
        self.totals = self._empty()  # over the steps taken
        self.steps = 0

    @staticmethod
    def _empty() -> dict:
        return {"bytes": {k: 0 for k in KINDS}, "calls": {k: 0 for k in KINDS}, "exposed_s": 0.0}

    def sent(self, kind: str, nbytes: int) -> None:
        """One collective of `kind` sent `nbytes` from this rank."""
        if not self.paused:
            self._step["bytes"][kind] += nbytes
            self._step["calls"][kind] += 1

    def blocked(self, seconds: float) -> None:
        """The step waited `seconds` on a collective (a wait() or a synchronous call)."""
        if not self.paused:
            self._step["exposed_s"] += seconds

    def discard_open_step(self) -> None:
        """Forget what was counted since the last step (the start-up broadcast of the weights)."""
        self._step = self._empty()

    def take_step(self) -> dict:
        """The open step's figures ({comm_bytes, comm_exposed_s, comm_bytes_<kind>...}); opens the next."""
        step, self._step = self._step, self._empty()
        self.steps += 1
        for kind in KINDS:
            self.totals["bytes"][kind] += step["bytes"][kind]
            self.totals["calls"][kind] += step["calls"][kind]
        self.totals["exposed_s"] += step["exposed_s"]
        return step_metrics(step, self.simulated_link_gbps)

    def summary(self) -> str:
        """One line for the end of a run: bytes per step by kind and the exposed time per step."""
        steps = max(1, self.steps)
        kinds = ", ".join(f"{k.replace('_', '-')} {format_wire_bytes(v / steps)}"
                          for k, v in self.totals["bytes"].items() if v)
        sim = (f"; SIMULATED link {self.simulated_link_gbps:g} Gb/s (collectives delayed by bytes / bandwidth)"
               if self.simulated_link_gbps else "")
        return (f"comm | per step and rank: {format_wire_bytes(sum(self.totals['bytes'].values()) / steps)} sent "
                f"({kinds or 'no collectives'}), {self.totals['exposed_s'] / steps * 1e3:.1f} ms exposed{sim}")


def per_step(summed: dict, steps: int) -> dict:
    """A window's summed comm_* fields as per-step means (of a constant, the constant: the link speed)."""
    return {k: v / steps for k, v in summed.items()} if steps else {}


def step_metrics(step: dict, simulated_link_gbps: float | None) -> dict:
    """Metrics fields for one step's tally: comm_bytes, comm_exposed_s, comm_bytes_<kind> (kinds used)."""
    out = {"comm_bytes": sum(step["bytes"].values()), "comm_exposed_s": step["exposed_s"]}
    out.update({f"comm_bytes_{k}": v for k, v in step["bytes"].items() if v})
    if simulated_link_gbps:
        out["comm_simulated_link_gbps"] = simulated_link_gbps
    return out
