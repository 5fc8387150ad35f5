"""The fused output layer + cross entropy against ``F.cross_entropy`` on full logits: losses and
gradients for any upstream gradient (mean, masked mean, arbitrary weights), ignored labels, odd
chunkings, bf16, tensor parallelism; and ``GPTModel``'s loss with and without the fused path."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_models import GPTModel, TransformerConfig
from mcore_models.hf.sharding import gather_tensor, load_full_state_dict
from mcore_models.models.gpt.linear_cross_entropy import linear_cross_entropy
from mcore_parallel import initialize_model_parallel, reduce_sequence_parallel_grads

N, H, V = 37, 16, 50


def _inputs(dtype=torch.float32, ignored=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator).to(dtype)
    weight = (torch.randn(V, H, generator=generator) * 0.3).to(dtype)
    target = torch.randint(0, V, (N,), generator=generator)
    if ignored:
        target[::5] = -100
    return hidden, weight, target


def _upstream(kind, target):
    """The gradient reaching the per-token losses from a mean, a masked mean or arbitrary weights."""
    if kind == "mean":
        return torch.full((N,), 1.0 / N)
    if kind == "masked_mean":
        mask = torch.ones(N)
        mask[1::4] = 0.0
        return mask / mask.sum()
    return torch.randn(N, generator=torch.Generator().manual_seed(1))


def _loss_and_grads(fn, hidden, weight, target, upstream):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    loss = fn(hidden, weight, target)
    loss.backward(upstream)
    return loss.detach(), hidden.grad, weight.grad


def _reference(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target, reduction="none")


@pytest.mark.parametrize("chunk_rows", [1, 7, 16, None])
@pytest.mark.parametrize("kind", ["mean", "masked_mean", "weighted"])
def test_matches_cross_entropy_of_full_logits(chunk_rows, kind):
    hidden, weight, target = _inputs()
    upstream = _upstream(kind, target)
    expected = _loss_and_grads(_reference, hidden, weight, target, upstream)
    got = _loss_and_grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=chunk_rows), hidden, weight, target, upstream
    )
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert (got[0][target == -100] == 0).all()
    assert (got[1][target == -100] == 0).all()


def test_bf16_within_rounding():
    hidden, weight, target = _inputs(torch.bfloat16)
    upstream = _upstream("masked_mean", target)
    expected = _loss_and_grads(_reference, hidden, weight, target, upstream)
    got = _loss_and_grads(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=8), hidden, weight, target, upstream
    )
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_only_the_needed_gradients_and_no_grad():
    hidden, weight, target = _inputs()
    frozen = weight.clone()
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, frozen, target).sum().backward()
    expected = torch.func.grad(lambda x: _reference(x, weight, target).sum())(hidden)
    torch.testing.assert_close(h.grad, expected, rtol=1e-5, atol=1e-6)
    w = weight.clone().requires_grad_()
    linear_cross_entropy(hidden, w, target).sum().backward()
    expected = torch.func.grad(lambda x: _reference(hidden, x, target).sum())(weight)
    torch.testing.assert_close(w.grad, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(
            linear_cross_entropy(hidden, weight, target), _reference(hidden, weight, target)
        )


def test_all_labels_ignored():
    hidden, weight, _ = _inputs()
    loss, grad_hidden, grad_weight = _loss_and_grads(
        linear_cross_entropy, hidden, weight, torch.full((N,), -100), torch.ones(N)
    )
    assert not loss.any() and not grad_hidden.any() and not grad_weight.any()


@pytest.mark.parametrize("cut", [30, V], ids=["uneven", "empty-shard"])
@pytest.mark.parametrize("kind", ["mean", "weighted"])
def test_vocab_parallel_matches_full_logits(kind, cut, run_distributed):
    hidden, weight, target = _inputs()
    upstream = _upstream(kind, target)
    expected = _loss_and_grads(_reference, hidden, weight, target, upstream)

    def body():
        rank = dist.get_rank()
        rows = [0, cut, V][rank : rank + 2]  # uneven shards, or all on rank 0
        group = dist.group.WORLD
        got = _loss_and_grads(
            lambda h, w, t: linear_cross_entropy(h, w, t, group=group, vocab_start=rows[0], chunk_rows=8),
            hidden,
            weight[rows[0] : rows[1]],
            target,
            upstream,
        )
        dist.all_reduce(got[1], group=group)  # the partial grad_hidden sums over ranks
        return got, rows

    for got, rows in run_distributed(body, 2, timeout=60):
        torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2], expected[2][rows[0] : rows[1]], rtol=1e-5, atol=1e-6)


def _config(**overrides):
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        make_vocab_size_divisible_by=16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **overrides,
    )


def _unfused(model):
    """A no-op hook on the output layer: ``GPTModel`` then takes the logits path."""
    return model.output_layer.register_forward_hook(lambda *args: None)


def _model_loss_and_grads(model, ids, labels, mask):
    model.zero_grad(set_to_none=True)
    losses = model(ids, labels=labels)
    ((losses * mask).sum() / mask.sum()).backward()
    return losses.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("vocab", [64, 61])  # 61: padded to 64, the padded ids never predicted
def test_gpt_model_loss_equals_the_logits_path(vocab, run_distributed, model_parallel):
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    labels[0, -1] = -100
    mask = (torch.arange(12) % 5 != 0).float().expand(2, 12)

    def body():
        torch.manual_seed(0)
        model = GPTModel(_config(), vocab, pg_collection=model_parallel(1))
        fused = _model_loss_and_grads(model, ids, labels, mask)
        with torch.no_grad():
            logits = model(ids)
        expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 12)
        errors = {"loss vs logits": (fused[0] - expected).abs().max().item()}
        handle = _unfused(model)
        unfused = _model_loss_and_grads(model, ids, labels, mask)
        handle.remove()
        errors["loss"] = (fused[0] - unfused[0]).abs().max().item()
        for name, grad in unfused[1].items():
            errors[name] = (fused[1][name] - grad).abs().max().item()
        return errors

    (errors,) = run_distributed(body, 1)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: {errors[worst]:.2e}"


def test_gpt_model_rejects_labels_out_of_range(run_distributed, model_parallel):
    def body():
        model = GPTModel(_config(), 61, pg_collection=model_parallel(1))
        try:
            model(torch.zeros(1, 4, dtype=torch.long), labels=torch.tensor([[1, 2, 61, 3]]))
        except ValueError as error:
            return str(error)
        return None

    (message,) = run_distributed(body, 1)
    assert message is not None and "labels must be in [0, 61) or -100, got 61" in message


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_model_tensor_parallel_loss_equals_the_logits_path(sequence_parallel, run_distributed):
    vocab = 61
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    mask = (torch.arange(8) % 3 != 0).float().expand(2, 8)

    def body():
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
        from mcore_parallel import ProcessGroupCollection

        torch.manual_seed(0)
        reference = GPTModel(
            _config(), vocab, pg_collection=ProcessGroupCollection(tp=singles[dist.get_rank()])
        )
        _unfused(reference)
        groups = initialize_model_parallel(tensor_model_parallel_size=2)
        config = _config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        model = GPTModel(config, vocab, pg_collection=groups)
        load_full_state_dict(model, reference.state_dict(), groups.tp)
        expected = _model_loss_and_grads(reference, ids, labels, mask)
        got = _model_loss_and_grads(model, ids, labels, mask)
        reduce_sequence_parallel_grads(model, groups.tp)
        errors = {"loss": (got[0] - expected[0]).abs().max().item()}
        params = dict(model.named_parameters())
        for name, grad in expected[1].items():
            local = got[1][name]
            local.tensor_model_parallel = getattr(params[name], "tensor_model_parallel", False)
            local.partition_dim = getattr(params[name], "partition_dim", 0)
            local.gated_halves = getattr(params[name], "gated_halves", False)
            errors[name] = (gather_tensor(local, groups.tp) - grad).abs().max().item()
        return errors

    for errors in run_distributed(body, 2, timeout=60):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, f"{worst}: {errors[worst]:.2e}"


def test_gpt_model_under_autocast_takes_the_logits_path(run_distributed, model_parallel):
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))

    def body():
        torch.manual_seed(0)
        model = GPTModel(_config(), 61, pg_collection=model_parallel(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fused = model(ids, labels=ids)
            handle = _unfused(model)
            unfused = model(ids, labels=ids)
        handle.remove()
        return (fused - unfused).abs().max().item()

    (error,) = run_distributed(body, 1)
    assert error == 0.0
