"""kl_estimate's three estimators against hand-computed values, and its typed errors."""

import math

import pytest
import torch
from mcore_rl import kl_estimate

LOGP = [-1.0, -2.0, -0.5, -3.0]
REF = [-1.5, -1.0, -0.5, -0.25]
# d = ref - logp = [-0.5, 1.0, 0.0, 2.75]
EXPECTED = {
    "k1": [0.5, -1.0, 0.0, -2.75],
    "k2": [0.25 / 2, 1.0 / 2, 0.0, 2.75**2 / 2],
    "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0, math.exp(2.75) - 2.75 - 1],
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_match_hand_computed_values(estimator):
    logp, ref = torch.tensor(LOGP, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64)
    torch.testing.assert_close(
        kl_estimate(logp, ref, estimator), torch.tensor(EXPECTED[estimator], dtype=torch.float64)
    )


def test_k3_is_the_default_and_its_gradient_is_one_minus_the_probability_ratio():
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(REF, dtype=torch.float64)
    kl_estimate(logp, ref).sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    expected = [1 - math.exp(r - lp) for lp, r in zip(LOGP, REF, strict=True)]
    torch.testing.assert_close(logp.grad, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize(
    ("logp", "ref_logp", "estimator", "error", "argument"),
    [
        (torch.zeros(3), torch.zeros(3), "k4", ValueError, "estimator"),
        (torch.zeros(3), torch.zeros(3), None, ValueError, "estimator"),
        (torch.zeros(3), torch.zeros(4), "k3", ValueError, "ref_logp"),
        (torch.zeros(3), [0.0, 0.0, 0.0], "k3", TypeError, "ref_logp"),
        (torch.zeros(3, dtype=torch.long), torch.zeros(3), "k3", TypeError, "logp"),
    ],
)
def test_bad_inputs_raise_typed_errors_naming_the_argument(logp, ref_logp, estimator, error, argument):
    with pytest.raises(error, match=f"^{argument}:"):
        kl_estimate(logp, ref_logp, estimator)
