"""TopKRouter: score functions, group-limited top-k, expert bias, aux losses, jitter, capacity;
oracles are hand-computed values and plain-PyTorch formulas written here."""

import math

import pytest
import torch
from mcore_models.transformer.moe import TopKRouter, group_limited_topk
from mcore_testing.moe_reference import moe_config


def _router(logits: torch.Tensor, **overrides) -> tuple[TopKRouter, torch.Tensor]:
    """A router whose logits on the returned hidden states are exactly ``logits [T, E]``:
    hidden = one-hot rows of an identity, weight = logits transposed."""
    tokens, experts = logits.shape
    config = moe_config(num_moe_experts=experts, **overrides)
    router = TopKRouter(config)
    hidden = torch.zeros(tokens, 1, config.hidden_size)
    hidden[:, 0, :tokens] = torch.eye(tokens)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :tokens] = logits.T
    return router, hidden


LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 2.5, 2.0], [0.0, 0.0, 1.0, 4.0]])


def test_softmax_post_and_pre_top_k():
    router, hidden = _router(LOGITS)
    out = router(hidden)
    assert out.indices.tolist() == [[1, 2], [2, 3], [3, 2]]
    expected = torch.softmax(LOGITS.gather(1, out.indices), dim=-1)
    torch.testing.assert_close(out.probs, expected)
    router, hidden = _router(LOGITS, moe_router_pre_softmax=True)
    out = router(hidden)
    torch.testing.assert_close(out.probs, torch.softmax(LOGITS, -1).gather(1, out.indices))


def test_linear_bias_moves_the_choice_and_the_probabilities():
    """GPT-OSS's router: logits = x W^T + b, top-k of them, softmax over the k."""
    router, hidden = _router(LOGITS, moe_router_linear_bias=True)
    assert router.bias is not None and router.bias.abs().sum() == 0  # zeros at init
    bias = torch.tensor([0.0, -2.5, 0.0, 1.5])
    with torch.no_grad():
        router.bias.copy_(bias)
    out = router(hidden)
    assert out.indices.tolist() == [[2, 3], [3, 2], [3, 2]]  # token 0: 3 - 2.5 < 0 + 1.5, expert 3 enters
    torch.testing.assert_close(out.probs, torch.softmax((LOGITS + bias).gather(1, out.indices), dim=-1))
    assert TopKRouter(moe_config()).bias is None


def test_sigmoid_scores_are_normalized_over_the_top_k():
    router, hidden = _router(LOGITS, moe_router_score_function="sigmoid")
    out = router(hidden)
    chosen = torch.sigmoid(LOGITS).gather(1, out.indices)
    torch.testing.assert_close(out.probs, chosen / chosen.sum(-1, keepdim=True))


def test_group_limited_top_k_by_hand():
    # Two groups {0, 1} and {2, 3}. Token 0: expert 0 is the single best, but group {2, 3} sums higher.
    scores = torch.tensor([[0.9, 0.01, 0.5, 0.45], [0.1, 0.2, 0.3, 0.25]])
    # topk=2, group_topk=1: each token keeps its single best group (group score = sum of its top 2).
    assert group_limited_topk(scores, 2, 2, 1).sort(-1).values.tolist() == [[2, 3], [2, 3]]
    # topk=2, group_topk=2: both groups (score = top-1 each), so plain top-2.
    assert group_limited_topk(scores, 2, 2, 2).sort(-1).values.tolist() == [[0, 2], [2, 3]]
    router, hidden = _router(
        torch.log(scores), moe_router_num_groups=2, moe_router_group_topk=1, moe_router_pre_softmax=True
    )
    assert router(hidden).indices.sort(-1).values.tolist() == [[2, 3], [2, 3]]


def test_expert_bias_changes_the_choice_not_the_weights_and_updates_towards_balance():
    router, hidden = _router(LOGITS, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.5)
    router.train()
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    out = router(hidden)
    assert (out.indices[:, 0] == 0).all()  # the bias put expert 0 first for every token
    scores = torch.softmax(LOGITS.gather(1, out.indices), -1)
    torch.testing.assert_close(out.probs, scores)  # weights from logits only
    counts = torch.bincount(out.indices.flatten(), minlength=4).float()
    torch.testing.assert_close(router.local_tokens_per_expert, counts)
    before = router.expert_bias.clone()
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, before + 0.5 * torch.sign(counts.mean() - counts))
    assert router.local_tokens_per_expert.sum() == 0
    state = router.state_dict()
    assert "expert_bias" in state
    fresh, _ = _router(LOGITS, moe_router_enable_expert_bias=True)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.expert_bias, router.expert_bias)


def _balance_reference(scores, indices, topk, coeff):
    tokens, experts = scores.shape
    counts = torch.zeros(experts)
    for e in indices.flatten().tolist():
        counts[e] += 1
    return coeff * experts * sum(counts[e] / (tokens * topk) * scores[:, e].mean() for e in range(experts))


def test_load_balancing_loss_global_and_per_sequence():
    torch.manual_seed(0)
    logits = torch.randn(6, 4)
    router, hidden = _router(logits, moe_aux_loss_coeff=0.1)
    router.train()
    out = router(hidden)
    scores = torch.softmax(logits, -1)
    torch.testing.assert_close(out.aux_loss, _balance_reference(scores, out.indices, 2, 0.1))
    # Per sequence: hidden [s=3, b=2, h]; token i * 2 + j belongs to sequence j.
    router.config.moe_router_load_balancing_type = "seq_aux_loss"
    out = router(hidden.view(3, 2, -1))
    per_seq = [_balance_reference(scores[j::2], out.indices[j::2], 2, 0.1) for j in range(2)]
    torch.testing.assert_close(out.aux_loss, sum(per_seq) / 2)
    assert list(router.last_losses) == ["load_balancing_loss"]
    assert float(router.last_losses["load_balancing_loss"]) == pytest.approx(float(out.aux_loss.detach()))
    router.eval()
    assert router(hidden).aux_loss is None  # losses are for training only


def test_z_loss_value():
    router, hidden = _router(LOGITS, moe_z_loss_coeff=0.01)
    router.train()
    expected = 0.01 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS.tolist()) / 3
    assert float(router(hidden).aux_loss.detach()) == pytest.approx(expected, rel=1e-5)


def test_input_jitter_is_made_in_the_input_dtype_and_only_in_training():
    config = moe_config(moe_input_jitter_eps=0.1, bf16=True)
    router = TopKRouter(config).train()
    hidden = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    hidden = hidden.masked_fill(hidden == 0, 1.0)  # the ratio below needs no zero entries
    jittered = router._jitter(hidden)
    assert jittered.dtype == torch.bfloat16
    ratio = jittered.float() / hidden.float()
    assert not torch.equal(jittered, hidden)
    assert ratio.min() >= 0.9 - 1e-2 and ratio.max() <= 1.1 + 1e-2
    assert torch.equal(router.eval()._jitter(hidden), hidden)
    assert router.train()(hidden.view(64, 1, -1)).probs.dtype == torch.bfloat16


def test_capacity_drops_by_probability_or_position():
    # 4 tokens, top-1 of 2 experts; capacity = ceil(4 * 1 / 2 * 0.5) = 1.
    logits = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    router, hidden = _router(
        logits, moe_router_topk=1, moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs"
    )
    out = router(hidden)
    assert out.keep.flatten().tolist() == [False, True, False, True]  # expert 0 keeps token 1 (highest)
    assert out.probs[0, 0] == 0 and out.probs[1, 0] > 0
    router.config.moe_token_drop_policy = "position"
    assert router(hidden).keep.flatten().tolist() == [True, False, False, True]  # earliest token
