"""``cross_entropy`` of given logits against ``F.cross_entropy``: losses and gradients in float32
for odd shapes (vocabularies 123 and 1000, 1, 5 and 37 tokens, leading dimensions), chunk sizes
not dividing the tokens, every reduction, label smoothing and ignored targets, bfloat16 within
rounding; the vocabulary-parallel form on 2 gloo ranks; what autograd keeps (the logits and a few
numbers per token); the Triton kernels under the interpreter and on a GPU; argument errors."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_kernels import cross_entropy, use_backend
from mcore_testing.triton_interpreter import interpreted_mismatches

# (shape, vocab, chunk_size, reduction, label_smoothing)
CASES = [
    ((1,), 123, None, "none", 0.0),
    ((5,), 1000, 2, "mean", 0.1),
    ((37,), 123, 8, "none", 0.2),
    ((37,), 1000, 7, "sum", 0.0),
    ((3, 5), 123, 4, "none", 0.0),
]


def _inputs(shape, vocab, *, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=generator)).to(dtype)
    target = torch.randint(0, vocab, shape, generator=generator)
    target.view(-1)[1::5] = -100
    upstream = torch.randn(shape, generator=generator)
    return logits, target, upstream


def _loss_and_grad(fn, logits, target, upstream):
    logits = logits.clone().requires_grad_()
    loss = fn(logits, target)
    loss.backward(upstream if loss.dim() else torch.tensor(1.7))
    return loss.detach(), logits.grad


def _full(logits, target, reduction, label_smoothing):
    """The oracle: PyTorch's cross entropy of the float32 logits, in the shape ``cross_entropy`` returns."""
    vocab = logits.shape[-1]
    loss = F.cross_entropy(
        logits.float().reshape(-1, vocab),
        target.reshape(-1),
        reduction=reduction,
        label_smoothing=label_smoothing,
    )
    return loss.view(target.shape) if reduction == "none" else loss


def _compare(case, backend):
    shape, vocab, chunk, reduction, smoothing = case
    logits, target, upstream = _inputs(shape, vocab, seed=vocab + len(shape))
    options = dict(reduction=reduction, label_smoothing=smoothing)

    def ours(x, t):
        with use_backend(backend):
            return cross_entropy(x, t, chunk_size=chunk, **options)

    expected = _loss_and_grad(lambda x, t: _full(x, t, **options), logits, target, upstream)
    return _loss_and_grad(ours, logits, target, upstream), expected


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_torch_cross_entropy(case):
    got, expected = _compare(case, "reference")
    for name, a, b in zip(("loss", "grad"), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_ignored_targets_have_no_loss_and_no_gradient():
    logits, target, upstream = _inputs((12,), 123)
    target[target == -100] = 0
    target[:4] = 7
    loss, grad = _loss_and_grad(
        lambda x, t: cross_entropy(x, t, ignore_index=7, reduction="none"), logits, target, upstream
    )
    assert not loss[:4].any() and not grad[:4].any()
    expected = F.cross_entropy(logits, target, ignore_index=7, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_bfloat16_within_rounding():
    logits, target, upstream = _inputs((37,), 123, dtype=torch.bfloat16)
    got = _loss_and_grad(
        lambda x, t: cross_entropy(x, t, reduction="none", chunk_size=8), logits, target, upstream
    )
    expected = _loss_and_grad(lambda x, t: _full(x, t, "none", 0.0), logits, target, upstream)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].float(), expected[1].float(), rtol=2e-2, atol=2e-3)


def test_backward_keeps_the_logits_and_a_few_numbers_per_token():
    tokens, vocab = 64, 1000
    logits, target, _ = _inputs((tokens,), vocab)
    logits.requires_grad_()
    kept = []

    def pack(tensor):
        kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cross_entropy(logits, target)
    shared = [tensor.data_ptr() == logits.data_ptr() for tensor in kept]
    assert any(shared)  # a view of the caller's logits, not a copy
    assert sum(tensor.numel() for tensor, view in zip(kept, shared, strict=True) if not view) <= 5 * tokens


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_matches_full_logits(smoothing, run_distributed):
    assert _vocab_parallel_errors(smoothing, "reference", run_distributed) == {}


def _vocab_parallel_errors(smoothing, backend, run):
    """Per rank, the outputs that differ from the oracle's: rank 0 holds 61 classes, rank 1 62."""
    logits, target, upstream = _inputs((37,), 123)
    expected = _loss_and_grad(lambda x, t: _full(x, t, "none", smoothing), logits, target, upstream)

    def body():
        columns = [0, 61, 123][dist.get_rank() : dist.get_rank() + 2]
        with use_backend(backend):
            got = _loss_and_grad(
                lambda x, t: cross_entropy(
                    x,
                    t,
                    group=dist.group.WORLD,
                    vocab_start=columns[0],
                    reduction="none",
                    label_smoothing=smoothing,
                ),
                logits[:, columns[0] : columns[1]],
                target,
                upstream,
            )
        return got, columns

    errors = {}
    for rank, ((loss, grad), columns) in enumerate(run(body, 2, timeout=60)):
        for name, a, b in (
            ("loss", loss, expected[0]),
            ("grad", grad, expected[1][:, columns[0] : columns[1]]),
        ):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                errors[f"rank {rank} {name}"] = (a - b).abs().max().item()
    return errors


def _interpreted_mismatches() -> list:
    """Run in a fresh process with ``TRITON_INTERPRET=1``: where the Triton kernels disagree with
    the oracle, in single blocks and in blocks of 64 columns, and vocabulary parallel on 2 ranks."""
    from mcore_kernels import cross_entropy_triton
    from mcore_testing.distributed import run_distributed

    mismatches = []
    for max_block in (cross_entropy_triton.MAX_BLOCK, 64):
        cross_entropy_triton.MAX_BLOCK = max_block
        for case in CASES:
            got, expected = _compare(case, "triton")
            for name, a, b in zip(("loss", "grad"), got, expected, strict=True):
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                    mismatches.append([str(case), max_block, name])
    errors = _vocab_parallel_errors(0.1, "triton", run_distributed)
    return mismatches + [["vocab parallel", name] for name in errors]


def test_triton_kernels_match_the_oracle_under_the_interpreter():
    assert interpreted_mismatches(__file__) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_kernels_match_the_reference_on_a_gpu(case):
    shape, vocab, chunk, reduction, smoothing = case
    logits, target, upstream = (t.cuda() for t in _inputs(shape, vocab, dtype=torch.bfloat16))
    results = []
    for backend in ("triton", "reference"):
        with use_backend(backend):
            results.append(
                _loss_and_grad(
                    lambda x, t: cross_entropy(
                        x, t, chunk_size=chunk, reduction=reduction, label_smoothing=smoothing
                    ),
                    logits,
                    target,
                    upstream,
                )
            )
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (dict(logits=torch.ones(4, 5, dtype=torch.int64)), TypeError, "logits must be a floating-point"),
        (dict(target=torch.zeros(4, dtype=torch.bool)), TypeError, "target must be an int64 or int32 tensor"),
        (dict(target=torch.zeros(4, 1, dtype=torch.int64)), ValueError, r"target must have shape \(4,\)"),
        (dict(target=torch.tensor([0, 5, 1, 2])), ValueError, "target 5 is not in the vocabulary"),
        (dict(reduction=None), ValueError, "reduction must be one of"),
        (dict(label_smoothing=-0.1), ValueError, r"label_smoothing must be a number in \[0, 1\)"),
        (dict(chunk_size=2.0), ValueError, "chunk_size must be a positive int"),
    ],
)
def test_bad_arguments_are_named(arguments, error, match):
    call = dict(logits=torch.randn(4, 5), target=torch.zeros(4, dtype=torch.int64)) | arguments
    with pytest.raises(error, match=match):
        cross_entropy(call.pop("logits"), call.pop("target"), **call)
