"""``GPTModel``'s loss through mcore-kernels' ``linear_cross_entropy`` (no full-vocabulary logits)
against the logits path (``output_layer`` then ``vocab_parallel_cross_entropy``): losses and every
parameter's gradient, padded vocabularies, tensor and sequence parallelism, labels out of range,
autocast. The op itself is tested in ``tests/mcore_kernels``."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_models import GPTModel, TransformerConfig
from mcore_models.hf.sharding import gather_full_tensor, load_full_state_dict
from mcore_parallel import initialize_model_parallel, reduce_sequence_parallel_grads


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
            errors[name] = (gather_full_tensor(local, groups.tp) - grad).abs().max().item()
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
