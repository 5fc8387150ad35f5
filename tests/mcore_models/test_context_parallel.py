"""Context parallelism against single-process oracles.

The layout by hand; attention over a split sequence (ring and all-gather exchange) against a naive
full-sequence attention written here; a ``GPTModel`` at CP = 2 and 4 against the same weights at
CP = 1: loss and every parameter gradient (summed over the CP ranks), float32. Tolerances: 1e-5
absolute on outputs and gradients (only the summation order differs; measured below 1e-6).
"""

import pytest
import torch
import torch.distributed as dist
from mcore_models import GPTModel, PackedSeqParams, TransformerConfig
from mcore_models.transformer.context_parallel import (
    context_parallel_attention,
    context_parallel_positions,
    gather_sequence,
    restore_sequence_order,
    split_batch,
    split_sequence,
)
from mcore_parallel import ProcessGroupCollection, initialize_model_parallel

TOL = 1e-5
VOCAB = 64


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert context_parallel_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert context_parallel_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    assert context_parallel_positions(16, 0, 4).tolist() == [0, 1, 14, 15]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_restore_undoes_split(cp):
    batch = {"tokens": torch.arange(24).view(1, 24) * 10, "loss_mask": torch.rand(1, 24)}
    pieces = [split_batch(batch, r, cp) for r in range(cp)]
    for name, full in batch.items():
        assert torch.equal(restore_sequence_order([p[name] for p in pieces]), full)
    hidden = torch.randn(24, 2, 3)  # [s, b, h]: the sequence first
    assert torch.equal(
        restore_sequence_order([split_sequence(hidden, r, cp, 0) for r in range(cp)], 0), hidden
    )


def test_bad_lengths_and_ranks_are_refused():
    with pytest.raises(ValueError, match="divisible by 2 x context_parallel_size"):
        split_sequence(torch.zeros(1, 6), 0, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        context_parallel_positions(8, 2, 2)


def naive_attention(q, k, v, window, sinks):
    """``q [s, b, n, d]``, ``k, v [s, b, g, d]``: loops over heads, the textbook formula."""
    s, b, n, d = q.shape
    out = torch.empty_like(q)
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    for head in range(n):
        group = head // (n // k.shape[2])
        scores = torch.einsum("sbd,tbd->bst", q[:, :, head], k[:, :, group]) / d**0.5
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks[head].expand(b, s, 1)
            probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out[:, :, head] = torch.einsum("bst,tbd->sbd", probs, v[:, :, group])
    return out


def _attention_body(comm_type, window, with_sinks):
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    seq, b, n, g, d = 4 * cp, 2, 4, 2, 8
    q = torch.randn(seq, b, n, d, generator=generator, requires_grad=True)
    k = torch.randn(seq, b, g, d, generator=generator, requires_grad=True)
    v = torch.randn(seq, b, g, d, generator=generator, requires_grad=True)
    sinks = torch.randn(n, generator=generator, requires_grad=True) if with_sinks else None
    upstream = torch.randn(seq, b, n, d, generator=generator)
    (naive_attention(q, k, v, window, sinks) * upstream).sum().backward()

    local = [split_sequence(x.detach(), rank, cp, 0).requires_grad_() for x in (q, k, v)]
    local_sinks = sinks.detach().clone().requires_grad_() if with_sinks else None
    out = context_parallel_attention(
        *local,
        cp_group=group,
        comm_type=comm_type,
        scale=d**-0.5,
        window_size=window,
        sink_logits=local_sinks,
    )
    (out * split_sequence(upstream, rank, cp, 0)).sum().backward()
    with torch.no_grad():
        full_out = gather_sequence(out, group, 0)
        errors = {"output": (full_out - naive_attention(q, k, v, window, sinks)).abs().max().item()}
    for name, mine, ref in zip("qkv", local, (q, k, v), strict=True):
        errors[f"grad {name}"] = (mine.grad - split_sequence(ref.grad, rank, cp, 0)).abs().max().item()
    if with_sinks:
        dist.all_reduce(local_sinks.grad)
        errors["grad sinks"] = (local_sinks.grad - sinks.grad).abs().max().item()
    return errors


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize(
    ("cp", "window", "with_sinks"), [(2, None, False), (2, 3, True), (4, None, True), (4, 5, False)]
)
def test_attention_over_a_split_sequence_equals_naive_full_attention(
    run_distributed, comm_type, cp, window, with_sinks
):
    for errors in run_distributed(_attention_body, cp, comm_type, window, with_sinks, timeout=60):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e}"


VARIANTS = {
    # RoPE, GQA, learnable sinks, qk-norm, a window on layer 1 only
    "rope-window-sinks": dict(
        normalization="RMSNorm",
        activation="swiglu",
        num_query_groups=2,
        qk_layernorm=True,
        softmax_type="learnable",
        position_embedding_type="rope",
        add_bias_linear=False,
        window_size=5,
        window_attn_skip_freq=[1, 0],
    ),
    # learned absolute positions: the embedding must see the true positions too
    "learned-positions": dict(softmax_type="off-by-one"),
}


def _config(variant, **overrides):
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        **{"attention_dropout": 0.0, "hidden_dropout": 0.0} | VARIANTS[variant] | overrides,
    )


def _gpt_body(variant, comm_type, seq, **overrides):
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = (torch.rand(2, seq, generator=generator) > 0.3).float()

    single = [dist.new_group([r]) for r in range(world)][rank]
    torch.manual_seed(0)
    reference = GPTModel(
        _config(variant, **overrides), VOCAB, pg_collection=ProcessGroupCollection(tp=single)
    )
    with torch.no_grad():  # non-zero sinks, so they matter
        for name, p in reference.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
    reference_loss = (reference(ids, labels=labels) * loss_mask).sum() / loss_mask.sum()
    reference_loss.backward()

    groups = initialize_model_parallel(context_parallel_size=world)
    model = GPTModel(
        _config(variant, context_parallel_size=world, cp_comm_type=comm_type, **overrides),
        VOCAB,
        pg_collection=groups,
    )
    model.load_state_dict(reference.state_dict())
    local = split_batch({"tokens": ids, "labels": labels, "loss_mask": loss_mask}, rank, world)
    per_token = gather_sequence(model(local["tokens"], labels=local["labels"]), groups.cp)
    loss = (per_token * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    errors = {"loss": (loss - reference_loss).abs().item()}
    with torch.no_grad():
        logits = gather_sequence(model(local["tokens"]), groups.cp)
        errors["logits"] = (logits - reference(ids)).abs().max().item()
    reference_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=groups.cp)  # each rank's gradient is that of its own tokens
        errors[f"grad {name}"] = (p.grad - reference_params[name].grad).abs().max().item()
    return errors


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_loss_and_gradients_equal_one_rank(run_distributed, variant, cp, comm_type):
    for errors in run_distributed(_gpt_body, cp, variant, comm_type, 16, timeout=90):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e}"


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_replays_the_exchange(run_distributed, recompute):
    """Recompute runs the ring again inside backward; every rank replays it in the same order."""
    overrides = {"recompute_granularity": recompute}
    for errors in run_distributed(_gpt_body, 2, "rope-window-sinks", "p2p", 8, timeout=90, **overrides):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"{worst}: {errors[worst]:.2e}"


def _refusals_body():
    groups = initialize_model_parallel(context_parallel_size=2)
    model = GPTModel(_config("rope-window-sinks", context_parallel_size=2), VOCAB, pg_collection=groups)
    ids = torch.zeros(1, 4, dtype=torch.long)
    refused = []
    for call in (
        lambda: model(torch.zeros(1, 3, dtype=torch.long)),  # 6 tokens in all: not divisible by 4
        lambda: model(ids, packed_seq_params=PackedSeqParams(cu_seqlens=torch.tensor([0, 2, 8]))),
        lambda: model(ids, attention_mask=torch.zeros(1, 1, 4, 8, dtype=torch.bool)),
    ):
        try:
            call()
        except ValueError as error:
            refused.append(str(error))
    try:
        GPTModel(_config("rope-window-sinks"), VOCAB, pg_collection=groups)
    except ValueError as error:
        refused.append(str(error))
    return refused


def test_unsupported_inputs_are_refused(run_distributed):
    refused = run_distributed(_refusals_body, 2)[0]
    assert len(refused) == 4
    assert "divisible by 2 x context_parallel_size" in refused[0]
    assert "packed sequences" in refused[1] and "packed sequences" in refused[2]
    assert "context_parallel_size (1)" in refused[3]
