"""``linear_cross_entropy`` against ``F.cross_entropy`` of the full logits ``F.linear(hidden,
weight)``: losses and gradients in float32 for odd shapes (vocabularies 123 and 1000, 1, 5 and 37
tokens), chunk sizes that do not divide the tokens, every reduction, label smoothing, ignored
targets, any upstream gradient (a mean, a masked mean, arbitrary weights: the recomputed rows),
bfloat16 within rounding; the vocabulary-parallel form on 2 gloo ranks (uneven and empty shards);
what autograd keeps (never full logits); the Triton kernels under the interpreter and on a GPU;
argument errors."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_kernels import linear_cross_entropy, use_backend
from mcore_testing.triton_interpreter import interpreted_mismatches

H = 16
# (tokens, vocab, chunk_size, reduction, label_smoothing): chunks of 1, chunks not dividing the
# tokens, the default (one chunk), more rows per chunk than tokens
CASES = [
    (1, 123, None, "none", 0.0),
    (5, 1000, 2, "mean", 0.0),
    (5, 123, 1, "sum", 0.1),
    (37, 123, 8, "none", 0.0),
    (37, 1000, 7, "mean", 0.2),
    (37, 1000, 64, "none", 0.1),
    (37, 123, None, "sum", 0.0),
]
UPSTREAMS = ("mean", "masked_mean", "weighted")


def _inputs(tokens, vocab, *, dtype=torch.float32, seed=0, ignored=True):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=generator).to(dtype)
    weight = (torch.randn(vocab, H, generator=generator) * 0.3).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    if ignored:
        target[1::5] = -100
    return hidden, weight, target


def _upstream(kind, reduction, tokens):
    """The gradient reaching the loss: for per-token losses, a mean's, a masked mean's or arbitrary."""
    if reduction != "none":
        return torch.tensor(1.7)
    if kind == "mean":
        return torch.full((tokens,), 1.0 / tokens)
    if kind == "masked_mean":
        mask = (torch.arange(tokens) % 4 != 1).float()
        return mask / mask.sum().clamp(min=1)
    return torch.randn(tokens, generator=torch.Generator().manual_seed(1))


def _full(hidden, weight, target, reduction="none", label_smoothing=0.0):
    """The oracle: full logits, then PyTorch's cross entropy."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, target, reduction=reduction, label_smoothing=label_smoothing)


def _loss_and_grads(fn, hidden, weight, target, upstream):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    loss = fn(hidden, weight, target)
    loss.backward(upstream)
    return loss.detach(), hidden.grad, weight.grad


def _compare(case, kind, backend):
    """``(ours, oracle)``: loss, grad_hidden and grad_weight of one case on ``backend``."""
    tokens, vocab, chunk, reduction, smoothing = case
    hidden, weight, target = _inputs(tokens, vocab, seed=tokens + vocab)
    upstream = _upstream(kind, reduction, tokens)
    options = dict(reduction=reduction, label_smoothing=smoothing)

    def ours(h, w, t):
        with use_backend(backend):
            return linear_cross_entropy(h, w, t, chunk_size=chunk, **options)

    expected = _loss_and_grads(lambda h, w, t: _full(h, w, t, **options), hidden, weight, target, upstream)
    return _loss_and_grads(ours, hidden, weight, target, upstream), expected


@pytest.mark.parametrize("kind", UPSTREAMS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_cross_entropy_of_full_logits(case, kind):
    got, expected = _compare(case, kind, "reference")
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_ignored_targets_have_no_loss_and_no_gradient():
    hidden, weight, target = _inputs(12, 123, ignored=False)
    target[:4] = 7
    loss, grad_hidden, _ = _loss_and_grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=7, reduction="none", chunk_size=5),
        hidden,
        weight,
        target,
        torch.ones(12),
    )
    assert not loss[:4].any() and not grad_hidden[:4].any()
    expected = F.cross_entropy(F.linear(hidden, weight), target, ignore_index=7, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_all_targets_ignored():
    hidden, weight, _ = _inputs(9, 123)
    target = torch.full((9,), -100)
    loss, grad_hidden, grad_weight = _loss_and_grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, reduction="none"), hidden, weight, target, torch.ones(9)
    )
    assert not loss.any() and not grad_hidden.any() and not grad_weight.any()
    assert linear_cross_entropy(hidden, weight, target).isnan()  # a mean over nothing, as torch's
    assert _full(hidden, weight, target, "mean").isnan()


def test_leading_dimensions_and_int32_targets():
    hidden, weight, target = _inputs(12, 123)
    loss = linear_cross_entropy(hidden.view(3, 4, H), weight, target.view(3, 4).int(), reduction="none")
    assert loss.shape == (3, 4)
    torch.testing.assert_close(loss.view(-1), _full(hidden, weight, target), rtol=1e-5, atol=1e-6)


def test_only_the_needed_gradients_and_no_grad():
    hidden, weight, target = _inputs(37, 123)
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, target, chunk_size=8).backward()
    expected = torch.func.grad(lambda x: _full(x, weight, target, "mean"))(hidden)
    torch.testing.assert_close(h.grad, expected, rtol=1e-5, atol=1e-6)
    w = weight.clone().requires_grad_()
    linear_cross_entropy(hidden, w, target, chunk_size=8).backward()
    expected = torch.func.grad(lambda x: _full(hidden, x, target, "mean"))(weight)
    torch.testing.assert_close(w.grad, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(
            linear_cross_entropy(hidden, weight, target), _full(hidden, weight, target, "mean")
        )


def test_no_gradients_are_computed_under_no_grad(monkeypatch):
    from mcore_kernels import cross_entropy_linear

    computed = []
    forward_chunks = cross_entropy_linear._forward_chunks

    def spy(*args):
        result = forward_chunks(*args)
        computed.append([grad is not None for grad in result[3:]])
        return result

    monkeypatch.setattr(cross_entropy_linear, "_forward_chunks", spy)
    hidden, weight, target = _inputs(37, 123)
    hidden.requires_grad_(), weight.requires_grad_()
    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, weight, target)
    trained = linear_cross_entropy(hidden, weight, target)
    assert computed == [[False, False], [True, True]]
    assert torch.equal(evaluated, trained.detach())


def test_bfloat16_within_rounding():
    hidden, weight, target = _inputs(37, 123, dtype=torch.bfloat16)
    upstream = _upstream("masked_mean", "none", 37)
    expected = _loss_and_grads(_full, hidden, weight, target, upstream)
    got = _loss_and_grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, reduction="none", chunk_size=8),
        hidden,
        weight,
        target,
        upstream,
    )
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def _saved_elements(fn, *inputs) -> list[int]:
    """The element counts of the tensors autograd keeps for ``fn(*inputs)``'s backward."""
    sizes = []

    def pack(tensor):
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*inputs)
    return sizes


def test_backward_keeps_no_full_logits():
    tokens, vocab = 64, 1000
    hidden, weight, target = _inputs(tokens, vocab)
    hidden.requires_grad_(), weight.requires_grad_()
    assert max(_saved_elements(_full, hidden, weight, target)) >= tokens * vocab  # the hooks see them
    kept = _saved_elements(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=16), hidden, weight, target
    )
    # the inputs, the float32 gradients of the same shapes and a few numbers per token
    assert sum(kept) <= 2 * (hidden.numel() + weight.numel()) + 8 * tokens < tokens * vocab


@pytest.mark.parametrize(
    ("cut", "smoothing"), [(61, 0.0), (61, 0.1), (123, 0.0)], ids=["uneven", "smoothed", "empty"]
)
@pytest.mark.parametrize("kind", ["mean", "weighted"])
def test_vocab_parallel_matches_full_logits(kind, cut, smoothing, run_distributed):
    assert _vocab_parallel_errors(kind, cut, smoothing, "reference", run_distributed) == {}


def test_vocab_parallel_target_outside_every_shard_is_named_on_every_rank(run_distributed):
    def body():
        rank = dist.get_rank()
        hidden, weight, _ = _inputs(4, 10)
        target = torch.tensor([0, 9, 10, 3])  # 10 classes over two shards of 5: 10 is in neither
        try:
            linear_cross_entropy(
                hidden, weight[5 * rank : 5 * rank + 5], target, group=dist.group.WORLD, vocab_start=5 * rank
            )
        except ValueError as error:
            return str(error)
        return None

    for message in run_distributed(body, 2, timeout=60):
        assert message is not None and "target 10 is not in exactly one rank's vocabulary shard" in message


def _vocab_parallel_errors(kind, cut, smoothing, backend, run):
    """Per rank, the outputs that differ from the oracle's (empty when all agree): rank 0 holds the
    classes below ``cut``, rank 1 the rest (none when ``cut`` is the vocabulary)."""
    vocab = 123
    hidden, weight, target = _inputs(37, vocab)
    upstream = _upstream(kind, "none", 37)
    options = dict(reduction="none", label_smoothing=smoothing)
    expected = _loss_and_grads(lambda h, w, t: _full(h, w, t, **options), hidden, weight, target, upstream)

    def body():
        rank = dist.get_rank()
        rows = [0, cut, vocab][rank : rank + 2]
        with use_backend(backend):
            got = _loss_and_grads(
                lambda h, w, t: linear_cross_entropy(
                    h, w, t, group=dist.group.WORLD, vocab_start=rows[0], chunk_size=8, **options
                ),
                hidden,
                weight[rows[0] : rows[1]],
                target,
                upstream,
            )
        dist.all_reduce(got[1])  # grad_hidden: each rank's partial sum
        return got, rows

    errors = {}
    for rank, (got, rows) in enumerate(run(body, 2, timeout=60)):
        wanted = (expected[0], expected[1], expected[2][rows[0] : rows[1]])
        for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, wanted, strict=True):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                errors[f"rank {rank} {name}"] = (a - b).abs().max().item()
    return errors


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: the cases (and outputs) where the Triton
    kernels disagree with the oracle, in single blocks and in blocks of 64 columns (the last
    one partial), and vocabulary parallel on 2 ranks."""
    from mcore_kernels import cross_entropy_triton
    from mcore_testing.distributed import run_distributed

    mismatches = []
    # weighted: every row's weight gradient recomputed in backward; a masked mean: most scaled
    for max_block, kind in ((cross_entropy_triton.MAX_BLOCK, "weighted"), (64, "masked_mean")):
        cross_entropy_triton.MAX_BLOCK = max_block
        for case in CASES:
            got, expected = _compare(case, kind, "triton")
            for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, expected, strict=True):
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                    mismatches.append([str(case), kind, max_block, name])
    for cut in (61, 123):  # uneven shards with label smoothing; all on rank 0
        errors = _vocab_parallel_errors("weighted", cut, 0.1, "triton", run_distributed)
        mismatches += [["vocab parallel", cut, name] for name in errors]
    return mismatches


def test_triton_kernels_match_the_oracle_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_kernels_match_the_reference_on_a_gpu(case):
    tokens, vocab, chunk, reduction, smoothing = case
    hidden, weight, target = (t.cuda() for t in _inputs(tokens, vocab, dtype=torch.bfloat16))
    upstream = _upstream("weighted", reduction, tokens).cuda()
    results = []
    for backend in ("triton", "reference"):
        with use_backend(backend):
            results.append(
                _loss_and_grads(
                    lambda h, w, t: linear_cross_entropy(
                        h, w, t, chunk_size=chunk, reduction=reduction, label_smoothing=smoothing
                    ),
                    hidden,
                    weight,
                    target,
                    upstream,
                )
            )
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (dict(hidden=torch.ones(4, H, dtype=torch.int64)), TypeError, "hidden must be a floating-point"),
        (dict(weight=torch.ones(5, H + 1)), ValueError, r"hidden \[..., h\] and weight \[v, h\]"),
        (dict(weight=torch.ones(5, H, dtype=torch.float64)), ValueError, "weight must be torch.float32"),
        (dict(target=torch.zeros(4)), TypeError, "target must be an int64 or int32 tensor"),
        (dict(target=torch.zeros(3, dtype=torch.int64)), ValueError, r"target must have shape \(4,\)"),
        (dict(target=torch.tensor([0, 5, 1, 2])), ValueError, "target 5 is not in the vocabulary"),
        (dict(target=torch.tensor([0, -1, 1, 2])), ValueError, "target -1 is not in the vocabulary"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(label_smoothing=1.0), ValueError, r"label_smoothing must be a number in \[0, 1\)"),
        (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
        (dict(vocab_start=-1), ValueError, "vocab_start must be an int >= 0"),
    ],
)
def test_bad_arguments_are_named(arguments, error, match):
    call = dict(hidden=torch.randn(4, H), weight=torch.randn(5, H), target=torch.zeros(4, dtype=torch.int64))
    call |= arguments
    with pytest.raises(error, match=match):
        linear_cross_entropy(call.pop("hidden"), call.pop("weight"), call.pop("target"), **call)
