"""grpo_loss against values and gradients worked out by hand, and its typed errors.

One batch serves every case: two completions, of 3 and 2 tokens, padded to 4 (NaN in the padding),
advantages 1.5 and -0.5, clip_low 0.2 and clip_high 0.28 (asymmetric), and per-token ratios
exp(logp - old_logp) chosen so that each regime occurs:

    completion 0 (A = 1.5):  1.25 (inside [0.8, 1.28]; clipped were the bounds swapped),
                             1.4 (above 1 + clip_high: clipped), 0.9 (inside)
    completion 1 (A = -0.5): 0.75 (below 1 - clip_low: clipped), 1.1 (inside)
"""

import math

import pytest
import torch
from mcore_rl import GRPOLossConfig, grpo_loss

NAN = float("nan")
MASK = [[True, True, True, False], [True, True, False, False]]
ADVANTAGES = [1.5, -0.5]
RATIOS = [[1.25, 1.4, 0.9], [0.75, 1.1]]
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2]]
REF = [[-1.5, -0.5, -1.0], [-0.8, -1.0]]  # ref - logp = [[-0.5, 0, 1], [-0.5, 0.2]]
ENTROPY = [[0.5, 1.0, 2.0], [0.25, 0.75]]
IS_WEIGHTS = [[1.5, 3.0, 0.5], [2.5, 0.8]]  # exp(old_logp - inference_logp), before the cap
CONFIG = GRPOLossConfig(clip_low=0.2, clip_high=0.28)

# The clipped surrogate min(r * A, clip(r, 0.8, 1.28) * A) per token, by hand:
POLICY = [[1.25 * 1.5, 1.28 * 1.5, 0.9 * 1.5], [0.8 * -0.5, 1.1 * -0.5]]
# Its derivative in logp: r * A where the unclipped term is the minimum, 0 where the clipped one is.
POLICY_GRAD = [[1.25 * 1.5, 0.0, 0.9 * 1.5], [0.0, 1.1 * -0.5]]
TOKENS = 5


def padded(rows, fill=NAN):
    return torch.tensor([row + [fill] * (4 - len(row)) for row in rows], dtype=torch.float64)


def batch(fill=NAN):
    """The batch's tensors, ``fill`` in the padding."""
    logp = padded(LOGP, fill)
    old = padded(
        [[lp - math.log(r) for lp, r in zip(*rows, strict=True)] for rows in zip(LOGP, RATIOS, strict=True)],
        fill,
    )
    inference = padded(
        [
            [lp - math.log(r) - math.log(w) for lp, r, w in zip(*rows, strict=True)]
            for rows in zip(LOGP, RATIOS, IS_WEIGHTS, strict=True)
        ],
        fill,
    )
    return {
        "logp": logp.requires_grad_(),
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float64),
        "completion_mask": torch.tensor(MASK),
        "old_logp": old,
        "ref_logp": padded(REF, fill),
        "entropy": padded(ENTROPY, fill),
        "inference_logp": inference,
    }


def run(config, fill=NAN, **overrides):
    inputs = {**batch(fill), **overrides}
    result = grpo_loss(config=config, **inputs)
    result.loss.backward()
    return result, inputs["logp"].grad


def token_mean(rows):
    return sum(sum(row) for row in rows) / TOKENS


def sequence_mean(rows):
    return sum(sum(row) / len(row) for row in rows) / len(rows)


def grad_tensor(rows):
    return padded(rows, 0.0)


def assert_scalar(value, expected):
    torch.testing.assert_close(value, torch.tensor(expected, dtype=torch.float64))


def test_token_mean_clips_low_and_high_asymmetrically():
    result, grad = run(CONFIG)
    assert_scalar(result.loss, -token_mean(POLICY))
    # d(-objective / count) / dlogp: -r * A / 5 on unclipped tokens, 0 on clipped and padded ones
    assert torch.equal(grad.isfinite(), torch.ones(2, 4, dtype=torch.bool))
    torch.testing.assert_close(grad, grad_tensor([[-g / TOKENS for g in row] for row in POLICY_GRAD]))
    metrics = result.metrics
    assert_scalar(metrics["clip_fraction_low"], 1 / 5)
    assert_scalar(metrics["clip_fraction_high"], 1 / 5)
    assert_scalar(metrics["ratio_mean"], (1.25 + 1.4 + 0.9 + 0.75 + 1.1) / 5)
    assert set(metrics) == {
        "clip_fraction_low",
        "clip_fraction_high",
        "ratio_mean",
        "kl_mean",
        "entropy_mean",
    }
    assert not any(value.requires_grad for value in metrics.values())


def test_sequence_mean_averages_each_completion_then_the_completions():
    result, grad = run(dataclass_replace(CONFIG, aggregation="sequence_mean"))
    assert_scalar(result.loss, -sequence_mean(POLICY))
    # each completion weighs 1/2, each of its tokens 1/len: 1/6 in completion 0, 1/4 in completion 1
    expected = [[-g / 6 for g in POLICY_GRAD[0]], [-g / 4 for g in POLICY_GRAD[1]]]
    torch.testing.assert_close(grad, grad_tensor(expected))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_kl_penalty(estimator, aggregation):
    d = [[r - lp for r, lp in zip(*rows, strict=True)] for rows in zip(REF, LOGP, strict=True)]
    kl = {
        "k1": [[-x for x in row] for row in d],
        "k2": [[x * x / 2 for x in row] for row in d],
        "k3": [[math.exp(x) - x - 1 for x in row] for row in d],
    }[estimator]
    config = dataclass_replace(CONFIG, beta=0.1, kl_estimator=estimator, aggregation=aggregation)
    result, _ = run(config)
    objective = [[p - 0.1 * k for p, k in zip(*rows, strict=True)] for rows in zip(POLICY, kl, strict=True)]
    mean = token_mean if aggregation == "token_mean" else sequence_mean
    assert_scalar(result.loss, -mean(objective))
    assert_scalar(result.metrics["kl_mean"], token_mean(kl))


def test_kl_gradient_adds_beta_times_the_estimators_derivative():
    _, grad = run(dataclass_replace(CONFIG, beta=0.1))
    # d k3 / dlogp = 1 - exp(ref - logp); the loss adds beta * k3 / count per token
    kl_grad = [
        [1 - math.exp(r - lp) for r, lp in zip(*rows, strict=True)] for rows in zip(REF, LOGP, strict=True)
    ]
    expected = [
        [(-g + 0.1 * k) / TOKENS for g, k in zip(*rows, strict=True)]
        for rows in zip(POLICY_GRAD, kl_grad, strict=True)
    ]
    torch.testing.assert_close(grad, grad_tensor(expected))


def test_beta_zero_ignores_the_reference():
    result, _ = run(CONFIG, ref_logp=None)
    assert_scalar(result.loss, -token_mean(POLICY))
    assert "kl_mean" not in result.metrics


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_entropy_bonus(aggregation):
    result, _ = run(dataclass_replace(CONFIG, entropy_coef=0.01, aggregation=aggregation))
    objective = [
        [p + 0.01 * h for p, h in zip(*rows, strict=True)] for rows in zip(POLICY, ENTROPY, strict=True)
    ]
    mean = token_mean if aggregation == "token_mean" else sequence_mean
    assert_scalar(result.loss, -mean(objective))
    assert_scalar(result.metrics["entropy_mean"], token_mean(ENTROPY))


def test_entropy_gradient_flows_into_the_entropies():
    entropy = padded(ENTROPY).requires_grad_()
    run(dataclass_replace(CONFIG, entropy_coef=0.01), entropy=entropy)
    torch.testing.assert_close(entropy.grad, grad_tensor([[-0.01 / TOKENS] * 3, [-0.01 / TOKENS] * 2]))


def test_truncated_importance_sampling_weights_the_policy_term_capped():
    result, grad = run(dataclass_replace(CONFIG, tis_cap=2.0, beta=0.1))
    capped = [[1.5, 2.0, 0.5], [2.0, 0.8]]  # 3.0 and 2.5 capped at 2
    d = [[r - lp for r, lp in zip(*rows, strict=True)] for rows in zip(REF, LOGP, strict=True)]
    k3 = [[math.exp(x) - x - 1 for x in row] for row in d]
    objective = [
        [w * p - 0.1 * k for w, p, k in zip(*rows, strict=True)]
        for rows in zip(capped, POLICY, k3, strict=True)
    ]
    assert_scalar(result.loss, -token_mean(objective))
    assert_scalar(result.metrics["tis_weight_mean"], token_mean(capped))
    kl_grad = [[1 - math.exp(x) for x in row] for row in d]
    expected = [
        [(-w * g + 0.1 * k) / TOKENS for w, g, k in zip(*rows, strict=True)]
        for rows in zip(capped, POLICY_GRAD, kl_grad, strict=True)
    ]
    torch.testing.assert_close(grad, grad_tensor(expected))


def test_without_a_cap_inference_logp_is_unused():
    result, _ = run(CONFIG, inference_logp=None)
    assert_scalar(result.loss, -token_mean(POLICY))
    assert "tis_weight_mean" not in result.metrics


def test_on_policy_ratio_is_one():
    result, grad = run(CONFIG, old_logp=None)
    # ratio 1 everywhere: objective A per token, gradient -A / count
    assert_scalar(result.loss, -(3 * 1.5 + 2 * -0.5) / TOKENS)
    torch.testing.assert_close(grad, grad_tensor([[-1.5 / TOKENS] * 3, [0.5 / TOKENS] * 2]))
    assert_scalar(result.metrics["ratio_mean"], 1.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_masked_tokens_are_ignored(aggregation):
    config = dataclass_replace(CONFIG, beta=0.1, entropy_coef=0.01, tis_cap=2.0, aggregation=aggregation)
    with_nan, nan_grad = run(config, fill=NAN)
    with_junk, junk_grad = run(config, fill=-1e4)
    assert torch.equal(with_nan.loss, with_junk.loss)
    assert torch.equal(nan_grad, junk_grad)
    assert (nan_grad[~torch.tensor(MASK)] == 0).all()
    for name, value in with_nan.metrics.items():
        assert torch.equal(value, with_junk.metrics[name]), name


def test_integer_mask_equals_bool_mask():
    as_bool, _ = run(CONFIG)
    as_int, _ = run(CONFIG, completion_mask=torch.tensor(MASK, dtype=torch.int64))
    assert torch.equal(as_bool.loss, as_int.loss)


def test_sequence_mean_skips_completions_without_tokens():
    inputs = batch(fill=0.0)
    extra = {
        name: torch.cat([value.detach(), value.detach()[:1]]) if value.dim() else value
        for name, value in inputs.items()
    }
    extra["completion_mask"] = torch.cat([inputs["completion_mask"], torch.zeros(1, 4, dtype=torch.bool)])
    config = dataclass_replace(CONFIG, aggregation="sequence_mean")
    assert_scalar(grpo_loss(config=config, **extra).loss, -sequence_mean(POLICY))


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_a_batch_without_tokens_has_zero_loss_and_gradient(aggregation):
    config = dataclass_replace(CONFIG, aggregation=aggregation)
    result, grad = run(config, completion_mask=torch.zeros(2, 4, dtype=torch.bool))
    assert result.loss.item() == 0.0
    assert (grad == 0).all()


def dataclass_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def _bad(**changes):
    return changes


BAD_INPUTS = [
    # (changes to the inputs, config, error, argument named)
    (_bad(logp=[[-1.0]]), CONFIG, TypeError, "logp"),
    (_bad(logp=torch.zeros(2, 4, dtype=torch.long)), CONFIG, TypeError, "logp"),
    (_bad(logp=torch.zeros(8)), CONFIG, ValueError, "logp"),
    (_bad(logp=torch.zeros(2, 4, 1)), CONFIG, ValueError, "logp"),
    (_bad(completion_mask=torch.ones(2, 4)), CONFIG, TypeError, "completion_mask"),
    (_bad(completion_mask=torch.ones(2, 3, dtype=torch.bool)), CONFIG, ValueError, "completion_mask"),
    (_bad(completion_mask=None), CONFIG, TypeError, "completion_mask"),
    (_bad(advantages=torch.zeros(2, 1, dtype=torch.float64)), CONFIG, ValueError, "advantages"),
    (_bad(advantages=torch.zeros(3, dtype=torch.float64)), CONFIG, ValueError, "advantages"),
    (_bad(advantages=torch.zeros(2, dtype=torch.long)), CONFIG, TypeError, "advantages"),
    (_bad(old_logp=torch.zeros(2, 3, dtype=torch.float64)), CONFIG, ValueError, "old_logp"),
    (_bad(old_logp=torch.zeros(2, 4, dtype=torch.long)), CONFIG, TypeError, "old_logp"),
    (_bad(ref_logp=None), dataclass_replace(CONFIG, beta=0.04), ValueError, "ref_logp"),
    (
        _bad(ref_logp=torch.zeros(4, 2, dtype=torch.float64)),
        dataclass_replace(CONFIG, beta=0.04),
        ValueError,
        "ref_logp",
    ),
    (_bad(entropy=None), dataclass_replace(CONFIG, entropy_coef=0.01), ValueError, "entropy"),
    (_bad(entropy=torch.zeros(2, dtype=torch.float64)), CONFIG, ValueError, "entropy"),
    (_bad(inference_logp=None), dataclass_replace(CONFIG, tis_cap=2.0), ValueError, "inference_logp"),
    (_bad(inference_logp=torch.zeros(2, 5, dtype=torch.float64)), CONFIG, ValueError, "inference_logp"),
    (_bad(), {"clip_low": 0.2}, TypeError, "config"),
]


@pytest.mark.parametrize(("changes", "config", "error", "argument"), BAD_INPUTS)
def test_bad_inputs_raise_typed_errors_naming_the_argument(changes, config, error, argument):
    inputs = {**batch(), **changes}
    with pytest.raises(error, match=f"^{argument}:"):
        grpo_loss(config=config, **inputs)
