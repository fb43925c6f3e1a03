"""Why a one-step-stale update (zero.offload_update delayed) can cost far more than one step: the largest stable
step of momentum with an exact, a delayed and an extrapolated gradient, on a quadratic.

    python -m benchmarks.delayed_stability [--betas 0,0.9,0.95]

Adam's update is m / sqrt(v) with m an average of gradients, m_t = b m_{t-1} + (1 - b) g. Along one eigenvector of
the Hessian, with the preconditioner 1 / sqrt(v) held still, a step multiplies the distance to the minimum by the
roots of a small linear recurrence in a = lr x (the preconditioned curvature). The exact rule is stable below
a = 2 (1 + b) / (1 - b): 38 for b = 0.9, the threshold Adam's preconditioned sharpness rises to and hovers at in
full-batch training (Cohen et al. 2022, "Adaptive gradient methods at the edge of stability"). The delayed rule
takes the gradient at the weights one update old; the extrapolated one at 2 M_{t-1} - M_{t-2}. Printed: the largest
stable a of each (by the recurrence's roots), and a check by torch's own optimizer (SGD with momentum b and
dampening b is that average) stepping f(x) = x^2 / 2 on either side of each threshold.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

RULES = ("exact", "delayed", "extrapolated")


def _step_matrix(a: float, beta: float, rule: str) -> np.ndarray:
    """The recurrence on (x_t, x_{t-1}, x_{t-2}, m_{t-1}): m_t = b m_{t-1} + (1 - b) g(p), x_{t+1} = x_t - a m_t,
    with g(p) = p on the quadratic and p the weights the gradient is taken at."""
    point = {"exact": [1, 0, 0, 0], "delayed": [0, 1, 0, 0], "extrapolated": [0, 2, -1, 0]}[rule]
    momentum = np.array([0, 0, 0, beta]) + (1 - beta) * np.array(point, dtype=float)
    weights = np.array([1, 0, 0, 0]) - a * momentum
    return np.array([weights, [1, 0, 0, 0], [0, 1, 0, 0], momentum])


def growth(a: float, beta: float, rule: str) -> float:
    """The factor a step multiplies the distance by in the long run (the largest root's modulus)."""
    return float(max(abs(np.linalg.eigvals(_step_matrix(a, beta, rule)))))


def largest_stable_step(beta: float, rule: str) -> float:
    """The largest a with growth <= 1, by bisection (growth rises with a past the threshold for these rules)."""
    low, high = 1e-3, 1e3
    for _ in range(80):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if growth(mid, beta, rule) <= 1 + 1e-12 else (low, mid)
    return low


def torch_run(a: float, beta: float, rule: str, steps: int = 400) -> float:
    """|x| after `steps` steps of torch.optim.SGD (momentum = dampening = beta: m = b m + (1 - b) g) on x^2 / 2 from
    x = 1, the gradient taken at the weights the rule names."""
    x = torch.ones(1, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([x], lr=a, momentum=beta, dampening=beta)
    history = [x.detach().clone(), x.detach().clone()]  # x_{t-1}, x_{t-2}
    for _ in range(steps):
        point = {"exact": x.detach(), "delayed": history[0],
                 "extrapolated": 2 * history[0] - history[1]}[rule]
        history = [x.detach().clone(), history[0]]
        x.grad = point.clone()  # the gradient of x^2 / 2 at the point
        optimizer.step()
        if not torch.isfinite(x.detach()).all() or abs(float(x.detach())) > 1e12:
            return float("inf")
    return abs(float(x.detach()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--betas", default="0,0.9,0.95", help="momentum (Adam's beta1) values")
    args = parser.parse_args(argv)
    table = {}
    print("| beta1 | rule | largest stable lr x curvature | growth per step at the exact rule's threshold | "
          "torch SGD-momentum at 0.9x / 1.1x the threshold, |x| after 400 steps from 1 |")
    print("| --- | --- | --- | --- | --- |")
    for beta in (float(b) for b in args.betas.split(",")):
        edge = largest_stable_step(beta, "exact")
        for rule in RULES:
            limit = largest_stable_step(beta, rule)
            table[beta, rule] = limit
            below, above = torch_run(0.9 * limit, beta, rule), torch_run(1.1 * limit, beta, rule)
            print(f"| {beta:g} | {rule} | {limit:.2f} | {growth(edge * 0.999, beta, rule):.2f} | "
                  f"{below:.2e} / {above:.2e} |")
    return table


if __name__ == "__main__":
    main()
