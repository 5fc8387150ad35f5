"""group_advantages and grpo_loss against TRL's GRPOTrainer (the peer; written against TRL 1.16.0)
on the same tensors.

TRL's advantages, importance-sampling weights and loss live inside ``GRPOTrainer`` methods that
read the trainer's attributes and call its model. The test runs the real methods,
``_generate_and_score_completions`` (rewards -> advantages, old/ref log-probs, vLLM importance
sampling) and ``_compute_loss``, on a stand-in trainer: a namespace with the attributes they read,
whose generation returns fixed completions and whose per-token log-prob function returns the test's
tensors (the rollout policy's, the reference's, or the trained policy's, by the model asked).

Settings that correspond (ours -> TRL):
    aggregation="sequence_mean"  -> loss_type="grpo"
    aggregation="token_mean"     -> loss_type="bnpo", or "dapo" (one process, no accumulation)
    clip_low, clip_high          -> epsilon, epsilon_high
    beta (kl_estimator="k3")     -> beta
    tis_cap                      -> use_vllm, vllm_importance_sampling_correction,
                                    vllm_importance_sampling_mode="token_truncate", clip_max=tis_cap
    scale_rewards                -> scale_rewards ("group" or "none")
"""

import dataclasses
import types
from collections import defaultdict, deque

import pytest
import torch
import trl  # noqa: F401  (the peer: a test dependency, never skipped)
from mcore_rl import GRPOLossConfig, group_advantages, grpo_loss
from trl.trainer.grpo_trainer import GRPOTrainer

G, N, T = 3, 4, 6  # groups, completions per group, padded completion length
LENGTHS = [6, 3, 5, 1, 6, 4, 2, 6, 5, 6, 3, 4]
# group 1 has equal rewards (zero variance)
REWARDS = [[1.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.2, 0.9, 0.4, 0.0]]
# In float64 throughout, but TRL's Bessel correction n / (n - 1) of integer counts is float32
# (about 1e-8 relative): advantages, and the losses made of them, agree to that.
TOLERANCE = {"rtol": 1e-7, "atol": 1e-9}


@dataclasses.dataclass
class Rollouts:
    mask: torch.Tensor
    logp: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    inference_logp: torch.Tensor
    entropy: torch.Tensor
    rewards: torch.Tensor


def rollouts(seed: int = 0) -> Rollouts:
    generator = torch.Generator().manual_seed(seed)

    def randn():
        return torch.randn(G * N, T, generator=generator, dtype=torch.float64)

    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    logp = -3 * torch.rand(G * N, T, generator=generator, dtype=torch.float64)
    old_logp = logp + 0.3 * randn()  # ratios from about 0.4 to 2.5: both clips bind on some tokens
    # TRL builds the sampling log-probs with torch.tensor(list of floats): float32
    inference_logp = (old_logp + 0.4 * randn()).float().double()
    return Rollouts(
        mask=mask,
        logp=logp,
        old_logp=old_logp,
        ref_logp=logp + 0.5 * randn(),
        inference_logp=inference_logp,
        entropy=2 * torch.rand(G * N, T, generator=generator, dtype=torch.float64),
        rewards=torch.tensor(REWARDS, dtype=torch.float64),
    )


class Accelerator:
    """One CPU process: gathers and reductions are the identity."""

    device = torch.device("cpu")
    num_processes = 1
    process_index = 0
    is_main_process = True
    sync_gradients = True

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, tensor):
        return tensor

    def reduce(self, tensor, reduction="sum"):
        return tensor


@dataclasses.dataclass
class TRLResult:
    loss: torch.Tensor
    grad: torch.Tensor
    advantages: torch.Tensor
    metrics: dict


def run_trl(
    data: Rollouts,
    *,
    loss_type,
    epsilon,
    epsilon_high,
    beta,
    entropy_coef,
    tis_cap,
    scale_rewards,
    off_policy,
):
    """TRL's advantages and loss of ``data``; the loss's gradient in the policy's log-probs."""
    rollout_policy = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    reference, trained = object(), object()
    logp = data.logp.clone().requires_grad_()

    def per_token_logps_and_entropies(model, *args, compute_entropy=False, **kwargs):
        if model is rollout_policy:
            return data.old_logp, None, None
        if model is reference:
            return data.ref_logp, None, None
        assert model is trained
        return logp, data.entropy if compute_entropy else None, None

    completion_ids = [[7] * length for length in LENGTHS]
    sampling_logps = [row[:length].tolist() for row, length in zip(data.inference_logp, LENGTHS, strict=True)]
    use_vllm = tis_cap is not None

    def generate(prompts):
        return (
            [[1, 2]] * len(prompts),  # prompt ids
            completion_ids,
            None,  # tool mask
            ["completion"] * len(prompts),
            sampling_logps if use_vllm else None,
            {},  # extra fields
            None,  # images
            [None] * len(prompts),  # tool images
        )

    trainer = types.SimpleNamespace(
        accelerator=Accelerator(),
        model=rollout_policy,
        ref_model=reference if beta else None,
        args=types.SimpleNamespace(
            gradient_checkpointing_kwargs=None,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            per_device_train_batch_size=G * N,
            use_bias_correction_kl=False,
            delta=None,
        ),
        # generation: fixed completions; with num_iterations=2 the rollouts are off policy and TRL
        # computes the rollout policy's log-probs (with vLLM it always does)
        environment_factories=None,
        tools=None,
        environments=None,
        _generate=generate,
        _tokenizer=types.SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        num_iterations=2 if off_policy else 1,
        use_vllm=use_vllm,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=tis_cap,
        beta=beta,
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies,
        # rewards and advantages
        _calculate_rewards=lambda inputs, prompts, completions, ids: data.rewards.view(-1, 1),
        num_generations=N,
        multi_objective_aggregation="sum_then_normalize",
        reward_weights=torch.ones(1, dtype=torch.float64),
        scale_rewards=scale_rewards,
        reward_func_names=["reward"],
        # logging
        _metrics=defaultdict(lambda: defaultdict(list)),
        _logs={
            "images": deque(),
            "prompt": deque(),
            "completion": deque(),
            "rewards": defaultdict(deque),
            "advantages": deque(),
            "extra": defaultdict(deque),
        },
        _pending_extra_logs=defaultdict(list),
        _pending_metrics=defaultdict(list),
        log_multimodal=False,
        # the loss
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=entropy_coef != 0.0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
        aux_loss_enabled=False,
        max_completion_length=T,
    )
    inputs = GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * (G * N))
    assert torch.equal(inputs["completion_mask"].bool(), data.mask)
    assert ("old_per_token_logps" in inputs) == (off_policy or use_vllm)
    loss = GRPOTrainer._compute_loss(trainer, trained, inputs)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return TRLResult(loss.detach(), logp.grad, inputs["advantages"], metrics)


def run_ours(data: Rollouts, config: GRPOLossConfig, *, off_policy: bool):
    advantages = group_advantages(data.rewards, config=config)
    logp = data.logp.clone().requires_grad_()
    result = grpo_loss(
        logp,
        advantages.advantages.view(-1),
        data.mask,
        config,
        old_logp=data.old_logp if off_policy or config.tis_cap is not None else None,
        ref_logp=data.ref_logp if config.beta else None,
        entropy=data.entropy,
        inference_logp=data.inference_logp if config.tis_cap is not None else None,
    )
    result.loss.backward()
    return result, logp.grad, advantages


CASES = {
    # name: (our config, TRL loss_type, off policy)
    "grpo-sequence-mean-asymmetric-clip": (
        GRPOLossConfig(clip_low=0.2, clip_high=0.28, aggregation="sequence_mean"),
        "grpo",
        True,
    ),
    "grpo-sequence-mean-kl-tis": (
        GRPOLossConfig(clip_low=0.2, clip_high=0.28, beta=0.04, tis_cap=2.0, aggregation="sequence_mean"),
        "grpo",
        True,
    ),
    "bnpo-token-mean-kl-tis": (
        GRPOLossConfig(clip_low=0.2, clip_high=0.28, beta=0.04, tis_cap=2.0),
        "bnpo",
        True,
    ),
    "dapo-token-mean-kl-tis-entropy-unscaled": (
        GRPOLossConfig(
            clip_low=0.1, clip_high=0.3, beta=0.1, tis_cap=1.5, entropy_coef=0.01, scale_rewards="none"
        ),
        "dapo",
        True,
    ),
    "bnpo-on-policy-kl": (GRPOLossConfig(beta=0.04), "bnpo", False),
    "dapo-on-policy-symmetric-clip": (GRPOLossConfig(clip_low=0.2, clip_high=0.2), "dapo", False),
}


def trl_settings(config: GRPOLossConfig, loss_type: str, off_policy: bool) -> dict:
    return {
        "loss_type": loss_type,
        "epsilon": config.clip_low,
        "epsilon_high": config.clip_high,
        "beta": config.beta,
        "entropy_coef": config.entropy_coef,
        "tis_cap": config.tis_cap,
        "scale_rewards": config.scale_rewards,
        "off_policy": off_policy,
    }


@pytest.mark.parametrize("name", list(CASES))
def test_loss_gradient_advantages_and_metrics_equal_trls(name):
    config, loss_type, off_policy = CASES[name]
    data = rollouts()
    ours, grad, advantages = run_ours(data, config, off_policy=off_policy)
    theirs = run_trl(data, **trl_settings(config, loss_type, off_policy))

    torch.testing.assert_close(advantages.advantages.view(-1), theirs.advantages, **TOLERANCE)
    torch.testing.assert_close(ours.loss.detach(), theirs.loss, **TOLERANCE)
    torch.testing.assert_close(grad, theirs.grad, **TOLERANCE)
    metrics = ours.metrics  # TRL averages flags (.float()) and the rewards' std in float32
    assert metrics["clip_fraction_low"].item() == pytest.approx(
        theirs.metrics["clip_ratio/low_mean"], rel=1e-6
    )
    assert metrics["clip_fraction_high"].item() == pytest.approx(
        theirs.metrics["clip_ratio/high_mean"], rel=1e-6
    )
    assert metrics["entropy_mean"].item() == pytest.approx(theirs.metrics["entropy"], rel=1e-6)
    if config.beta:
        assert metrics["kl_mean"].item() == pytest.approx(theirs.metrics["kl"], rel=1e-6)
    if config.tis_cap is not None:
        tis_mean = theirs.metrics["sampling/importance_sampling_ratio/mean"]
        assert metrics["tis_weight_mean"].item() == pytest.approx(tis_mean, rel=1e-6)
    zero_variance_fraction = advantages.zero_variance.double().mean().item()
    assert zero_variance_fraction == pytest.approx(theirs.metrics["frac_reward_zero_std"], rel=1e-6)
    if off_policy:  # the case exercises what it names
        assert metrics["clip_fraction_low"] > 0 and metrics["clip_fraction_high"] > 0


def test_some_importance_weights_reach_the_cap():
    data = rollouts()
    weights = torch.exp(data.old_logp - data.inference_logp)[data.mask]
    assert (weights > 2.0).any() and (weights < 1.0).any()


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_flat_rewards_give_trls_advantages(scale_rewards):
    data = rollouts(seed=1)
    config = GRPOLossConfig(scale_rewards=scale_rewards)
    theirs = run_trl(data, **trl_settings(config, "bnpo", off_policy=False))
    ours = group_advantages(data.rewards.view(-1), group_size=N, config=config)
    torch.testing.assert_close(ours.advantages, theirs.advantages, **TOLERANCE)


def test_sequence_mean_entropy_bonus_is_aggregated_like_the_rest_of_the_objective():
    """The one documented difference: with loss_type="grpo", TRL adds the token mean of the
    entropies; grpo_loss aggregates them like the rest of the per-token objective (sequence mean)."""
    data = rollouts(seed=2)
    config = GRPOLossConfig(
        clip_low=0.2, clip_high=0.28, beta=0.04, entropy_coef=0.01, aggregation="sequence_mean"
    )
    ours, _, _ = run_ours(data, config, off_policy=True)
    theirs = run_trl(data, **trl_settings(config, "grpo", off_policy=True))
    entropy = torch.where(data.mask, data.entropy, 0.0)
    counts = data.mask.sum(dim=1)
    token_mean = entropy.sum() / counts.sum()
    sequence_mean = (entropy.sum(dim=1) / counts).mean()
    assert sequence_mean != pytest.approx(token_mean.item())
    torch.testing.assert_close(
        ours.loss.detach() - theirs.loss, 0.01 * (token_mean - sequence_mean), **TOLERANCE
    )
