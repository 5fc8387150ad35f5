"""The engine on tensor-parallel ranks and on Hugging Face Llama / Qwen2 / Mixtral / Qwen2-MoE /
GPT-OSS checkpoints imported with mcore-models (the MoE ones with sequential experts, Mixtral and GPT-OSS
also with grouped experts): greedy outputs equal the full-recompute oracle and HF
``generate``."""

import pytest
import torch
from mcore_inference import RequestStatus, SamplingParams

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, num_tokens_to_generate=6)


def test_tensor_parallel_two_ranks_matches_oracle(
    run_distributed, model_builder, make_engine, oracle, prompts_factory
):
    def body():
        import torch.distributed as dist
        from mcore_parallel import initialize_model_parallel

        prompts = prompts_factory(5, 2, 20, seed=40)
        model = model_builder(groups=initialize_model_parallel(tensor_model_parallel_size=2), tp=2)
        expected = [oracle(model, p, 6) for p in prompts]  # the TP model's own full recompute
        engine = make_engine(model, blocks=20, max_tokens=10)  # small: chunking and preemption
        seeded = SamplingParams(temperature=1.0, seed=dist.get_rank(), num_tokens_to_generate=6)
        requests = engine.generate([*prompts, prompts[0]], [GREEDY] * 5 + [seeded])
        assert all(r.status is RequestStatus.COMPLETED for r in requests)
        assert model.parallel_output  # full-vocabulary logits without switching the model's output
        return [r.generated_tokens for r in requests[:5]] == expected, requests[5].generated_tokens

    (same0, sampled0), (same1, sampled1) = run_distributed(body, 2, timeout=120)
    assert same0 and same1
    assert sampled0 == sampled1  # ranks agree on sampled tokens even with different seeds


# Mixtral, Qwen2-MoE and GPT-OSS: MoE layers (top-2 routing, Qwen2-MoE's gated shared expert) in the engine.
_MOE = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    # GPT-OSS: sinks, sliding (window 4, shorter than the prompts) and full layers, YaRN, biased
    # router and experts with the clamped SwiGLU.
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": 4,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
    },
}
_FAMILIES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2Moe",
    "gpt_oss": "GptOss",
}


_CASES = [(family, False) for family in _FAMILIES] + [(family, True) for family in ("mixtral", "gpt_oss")]


@pytest.mark.parametrize(
    ("family", "grouped"), _CASES, ids=[f + ("-grouped-experts" if g else "") for f, g in _CASES]
)
def test_hf_imported_models(
    groups, tmp_path, family, grouped, make_engine, oracle, prompts_factory, hf_tiny_config
):
    transformers = pytest.importorskip("transformers")
    from mcore_models import import_hf_checkpoint

    common = dict(
        hf_tiny_config,
        max_position_embeddings=256,
        # No end-of-sequence id: generate's min_new_tokens would forbid it where ignore_eos only
        # keeps going, so the two differ whenever the argmax is that id.
        eos_token_id=None,
    )
    torch.manual_seed(0)  # weights independent of the tests run before
    name = _FAMILIES[family]
    config = getattr(transformers, f"{name}Config")(**common, **_MOE.get(family, {}))
    hf_model = getattr(transformers, f"{name}ForCausalLM")(config)
    if family == "gpt_oss":
        _redraw_gpt_oss_features(hf_model)
    hf_model.save_pretrained(tmp_path)
    model = import_hf_checkpoint(tmp_path, pg_collection=groups, moe_grouped_gemm=grouped)
    prompts = prompts_factory(3, 3, 15, seed=41)
    requests = make_engine(model, max_tokens=8).generate(prompts, GREEDY)
    for prompt, request in zip(prompts, requests, strict=True):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert request.generated_tokens == oracle(model, prompt, 6) == expected[0, len(prompt) :].tolist()


def _redraw_gpt_oss_features(hf_model):
    """Sinks, router bias and expert projections large enough to matter (the init makes the sinks
    and biases tiny and never reaches the clamp of the SwiGLU)."""
    with torch.no_grad():
        for layer in hf_model.model.layers:
            for param, std in (
                (layer.self_attn.sinks, 1.0),
                (layer.mlp.router.bias, 1.0),
                (layer.mlp.experts.gate_up_proj, 1.0),
                (layer.mlp.experts.gate_up_proj_bias, 0.5),
            ):
                param.normal_(0.0, std)
