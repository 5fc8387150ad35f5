"""GPTModel behaviour against single-process references: tensor and sequence parallelism, pipeline
stages, packed sequences and activation recompute. fp32; tolerances stated per test."""

import pytest
import torch
import torch.distributed as dist
from mcore_models import GPTModel, PackedSeqParams, TransformerConfig
from mcore_models.hf.sharding import gather_full_tensor, load_full_state_dict
from mcore_parallel import ProcessGroupCollection, initialize_model_parallel, reduce_sequence_parallel_grads

VOCAB = 64
VARIANTS = {
    # GQA, swiglu, RMSNorm, qk-norm, learnable sinks, rope, a window on layer 1 only
    "llama-like": dict(
        normalization="RMSNorm",
        activation="swiglu",
        num_query_groups=2,
        qk_layernorm=True,
        softmax_type="learnable",
        position_embedding_type="rope",
        add_bias_linear=False,
        window_size=3,
        window_attn_skip_freq=[1, 0],
    ),
    # learned positions, LayerNorm and biases, off-by-one softmax, quick-GeGLU with offset, yarn absent
    "gpt-like": dict(softmax_type="off-by-one", activation="quick_geglu", glu_linear_offset=1.0),
    "yarn-squared-relu": dict(
        position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0, activation="squared_relu"
    ),
    # MoE layers: routed experts (replicated over TP ranks), a gated shared expert (TP-sharded),
    # router losses on
    "moe": dict(
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        num_moe_experts=4,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
    ),
}
# MoE layers do not support sequence parallelism.
TENSOR_PARALLEL_CASES = [
    (variant, sequence_parallel)
    for variant in VARIANTS
    for sequence_parallel in (False, True)
    if not (sequence_parallel and "num_moe_experts" in VARIANTS[variant])
]


def _config(variant, **overrides):
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        **{"attention_dropout": 0.0, "hidden_dropout": 0.0} | VARIANTS[variant] | overrides,
    )


def _single_rank_groups() -> ProcessGroupCollection:
    """Groups of one rank each, for a TP=1 reference next to a TP=2 model (collective)."""
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return ProcessGroupCollection(tp=singles[dist.get_rank()])


def _reference(variant, groups, **overrides):
    torch.manual_seed(0)
    return GPTModel(_config(variant, **overrides), VOCAB, pg_collection=groups)


def _with_sinks(model):
    """Make learned sinks non-zero so they matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
    return model


@pytest.mark.parametrize(("variant", "sequence_parallel"), TENSOR_PARALLEL_CASES)
def test_tensor_and_sequence_parallel_match_one_process(variant, sequence_parallel, run_distributed):
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)

    def body():
        reference = _with_sinks(_reference(variant, _single_rank_groups()))
        groups = initialize_model_parallel(tensor_model_parallel_size=2)
        config = _config(variant, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        model = GPTModel(config, VOCAB, pg_collection=groups, parallel_output=False)
        load_full_state_dict(model, reference.state_dict(), groups.tp)
        errors = {}
        for m in (reference, model):
            m(ids, labels=labels).sum().backward()
        with torch.no_grad():
            errors["logits"] = (model(ids) - reference(ids)).abs().max().item()
        reduce_sequence_parallel_grads(model, groups.tp)
        params = dict(model.named_parameters())
        for name, p in reference.named_parameters():
            grad = params[name].grad.detach()
            grad.tensor_model_parallel = getattr(params[name], "tensor_model_parallel", False)
            grad.partition_dim = getattr(params[name], "partition_dim", 0)
            grad.gated_halves = getattr(params[name], "gated_halves", False)
            errors[name] = (gather_full_tensor(grad, groups.tp) - p.grad).abs().max().item()
        return errors

    for errors in run_distributed(body, 2, timeout=60):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, f"{worst}: {errors[worst]:.2e}"


def test_pipeline_stages_match_the_whole_model(run_distributed):
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))

    def body():
        reference = _reference("llama-like", _single_rank_groups()).eval()
        groups = initialize_model_parallel(pipeline_model_parallel_size=2)
        stage = dist.get_rank(groups.pp)
        torch.manual_seed(0)
        model = GPTModel(
            _config("llama-like"),
            VOCAB,
            pre_process=stage == 0,
            post_process=stage == 1,
            pg_collection=groups,
        ).eval()
        full = reference.state_dict()
        local = {}
        for name in model.state_dict():
            source = name.replace("decoder.layers.0.", f"decoder.layers.{stage}.")
            local[name] = full[source]
        model.load_state_dict(local)
        with torch.no_grad():
            if stage == 0:
                dist.send(model(ids), dist.get_global_rank(groups.pp, 1), group=groups.pp)
                return None
            hidden = torch.empty(8, 2, 32)
            dist.recv(hidden, dist.get_global_rank(groups.pp, 0), group=groups.pp)
            model.set_input_tensor(hidden)
            return (model(ids) - reference(ids)).abs().max().item()

    _, error = run_distributed(body, 2, timeout=60)
    assert error <= 1e-6


@pytest.mark.parametrize("how", ["cu_seqlens", "position_ids"])
def test_packed_documents_equal_separate_forwards(how, run_distributed, model_parallel):
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))

    def body():
        model = _with_sinks(_reference("llama-like", model_parallel(1))).eval()
        with torch.no_grad():
            separate = torch.cat([model(ids[:, :5]), model(ids[:, 5:])], dim=1)
            if how == "cu_seqlens":
                packed = model(ids, packed_seq_params=PackedSeqParams(torch.tensor([0, 5, 12])))
            else:
                positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
                packed = model(ids, position_ids=positions)
            unpacked = model(ids)
        return (packed - separate).abs().max().item(), (unpacked - separate).abs().max().item()

    ((error, unpacked_error),) = run_distributed(body, 1)
    assert error <= 1e-5
    assert unpacked_error > 1e-3  # without document boundaries the second document sees the first


def test_rows_of_packed_documents_take_the_fused_path_and_equal_separate_forwards(
    run_distributed, model_parallel
):
    """Vanilla causal attention (GQA, no window or sinks) over a batch of two packed rows with
    different document boundaries goes through ``scaled_dot_product_attention`` with each row's
    document mask, and equals each document's own forward."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    documents = [[(0, 5), (5, 12)], [(0, 3), (3, 12)]]

    def body():
        plain = dict(softmax_type="vanilla", window_size=None, window_attn_skip_freq=None)
        model = _reference("llama-like", model_parallel(1), **plain).eval()
        positions = torch.stack([torch.cat([torch.arange(b - a) for a, b in row]) for row in documents])
        masked_calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

        def spy(*args, attn_mask=None, **kwargs):
            masked_calls.append(attn_mask is not None)
            return sdpa(*args, attn_mask=attn_mask, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = spy
        with torch.no_grad():
            packed = model(ids, position_ids=positions)
        torch.nn.functional.scaled_dot_product_attention = sdpa
        with torch.no_grad():
            separate = torch.stack(
                [
                    torch.cat([model(ids[r : r + 1, a:b])[0] for a, b in row])
                    for r, row in enumerate(documents)
                ]
            )
        return (packed - separate).abs().max().item(), masked_calls

    ((error, masked_calls),) = run_distributed(body, 1)
    assert error <= 1e-5
    assert masked_calls == [True, True]  # both layers, fused with the document mask


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        dict(recompute_granularity="selective"),
    ],
    ids=["full-uniform-1", "full-uniform-2", "full-block-1", "selective"],
)
@pytest.mark.parametrize("variant", ["llama-like", "moe"])
def test_activation_recompute_gives_the_same_gradients(variant, recompute, run_distributed, model_parallel):
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))

    # router input jitter: the recomputation must also replay its noise
    jitter = {"moe_input_jitter_eps": 0.05} if variant == "moe" else {}

    def body():
        groups = model_parallel(1)
        grads = []
        for overrides in ({}, recompute):
            # dropout on: the recomputation must replay the forward's masks
            torch.manual_seed(0)
            model = GPTModel(
                _config(variant, attention_dropout=0.2, hidden_dropout=0.2, **overrides, **jitter),
                VOCAB,
                pg_collection=groups,
            )
            _with_sinks(model).train()
            torch.manual_seed(1)
            model(ids, labels=ids).sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        return max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])

    assert run_distributed(body, 1)[0] <= 1e-6


@pytest.mark.parametrize("variant", ["llama-like", "gpt-like"])
def test_tensor_parallel_model_draws_the_one_process_weights(variant, run_distributed):
    """Seeded alike, a TP = 2 model holds the slices of the TP = 1 model's weights; a gated fc1 holds
    ``[its gate slice; its up slice]`` of the one process's ``[gate; up]``."""

    def body():
        expected = _reference(variant, _single_rank_groups()).state_dict()
        groups = initialize_model_parallel(tensor_model_parallel_size=2)
        torch.manual_seed(0)
        model = GPTModel(_config(variant, tensor_model_parallel_size=2), VOCAB, pg_collection=groups)
        params = dict(model.named_parameters())
        return {
            name: torch.equal(gather_full_tensor(params[name], groups.tp), value)
            for name, value in expected.items()
            if name in params
        }

    for equal in run_distributed(body, 2, timeout=60):
        assert any("linear_fc1" in name for name in equal)
        assert all(equal.values()), [name for name, same in equal.items() if not same]
