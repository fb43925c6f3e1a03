"""benchmarks/delayed_stability.py: the stability thresholds RESULTS.md and docs/zero-and-offload.md quote, held to
the closed form where there is one and to torch's own optimizer stepping either side of each."""
import pytest

from benchmarks.delayed_stability import largest_stable_step, torch_run


@pytest.mark.parametrize("beta", [0.0, 0.9, 0.95])
def test_the_exact_threshold_is_the_closed_form_and_the_delayed_one_is_1(beta):
    assert largest_stable_step(beta, "exact") == pytest.approx(2 * (1 + beta) / (1 - beta), rel=1e-6)  # 38 at 0.9
    assert largest_stable_step(beta, "delayed") == pytest.approx(1.0, rel=1e-6)


def test_extrapolation_raises_the_delayed_threshold_only_a_little_at_adams_beta1():
    assert largest_stable_step(0.9, "extrapolated") == pytest.approx(2.70, abs=0.01)


@pytest.mark.parametrize("beta, rule", [(0.9, "exact"), (0.9, "delayed"), (0.9, "extrapolated"), (0.0, "delayed")])
def test_torch_sgd_momentum_converges_below_each_threshold_and_grows_above_it(beta, rule):
    limit = largest_stable_step(beta, rule)
    assert torch_run(0.9 * limit, beta, rule) < 1.0
    assert torch_run(1.1 * limit, beta, rule) > 1.0


def test_halfway_to_the_exact_edge_the_delayed_rule_diverges():
    assert torch_run(19.0, 0.9, "exact") < 1e-6
    assert torch_run(19.0, 0.9, "delayed") == float("inf")
