"""``HybridModel`` and ``import_nemotron_h`` against Hugging Face's ``NemotronHForCausalLM``.

Oracle: a random-weight transformers NemotronH (fp32) with Mamba, attention, MLP and MoE layers
(random expert biases, so the biased top-k choice matters; some Mamba time steps below
``time_step_min``, so its clamp matters); our logits equal its logits within
1e-4 at TP = 1 (imported from the module and from a saved directory) and TP = 2; the per-token
loss equals ``F.cross_entropy`` of its logits; a training backward gives finite gradients.
Unsupported inputs fail with errors naming the field, before any weight is read.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers  # imported here so forked ranks inherit it
from mcore_models.config.transformer_config import TransformerConfig
from mcore_models.models.hybrid import HybridModel, import_nemotron_h, nemotron_h_configs
from mcore_models.ssm import MambaConfig
from mcore_parallel import ConfigError
from mcore_testing.nemotron_h import TINY_NEMOTRON_H

TOLERANCE = 1e-4
VOCAB = 64
PATTERN = "M*-EM"
_TYPES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
HF_CONFIG = TINY_NEMOTRON_H | dict(vocab_size=VOCAB, hybrid_override_pattern=PATTERN)


def _hf_model(**changes) -> transformers.NemotronHForCausalLM:
    config = transformers.NemotronHConfig(**(HF_CONFIG | changes))
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        # time steps of half the heads of layer 0 below time_step_min, where transformers clamps them
        # (with inputs large enough for the scan, not the D skip, to dominate its output)
        model.model.layers[0].mixer.dt_bias[::2] = -10.0
        model.model.layers[0].mixer.in_proj.weight *= 25.0
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(checkpoint directory, input ids [2, 12], HF logits)."""
    model = _hf_model()
    directory = tmp_path_factory.mktemp("nemotron_h")
    model.save_pretrained(directory)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return directory, ids, logits


def test_pattern_has_every_layer_type():
    assert sorted(set(PATTERN)) == sorted(_TYPES)


def test_one_process_logits_loss_and_backward(reference, run_distributed, model_parallel):
    directory, ids, expected = reference

    def body():
        groups = model_parallel(1)
        from_module = import_nemotron_h(_hf_model(), pg_collection=groups)
        model = import_nemotron_h(directory, pg_collection=groups)
        assert [layer.layer_type for layer in model.decoder.layers] == [_TYPES[s] for s in PATTERN]
        with torch.no_grad():
            errors = [(m(ids) - expected).abs().max().item() for m in (from_module, model)]
            labels = torch.roll(ids, -1, dims=1)
            loss = model(ids, labels=labels)
        reference_loss = F.cross_entropy(expected.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        loss_error = (loss - reference_loss.view_as(labels)).abs().max().item()

        model.train()
        model(ids, labels=labels).mean().backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        assert all(g is None or torch.isfinite(g).all() for g in grads.values())
        for name in (
            "0.mixer.in_proj",
            "0.mixer.A_log",
            "1.mixer.linear_qkv",
            "2.mixer.linear_fc1",
            "3.mixer.router",
        ):
            grad = next(g for n, g in grads.items() if f"layers.{name}" in n)
            assert grad is not None and grad.abs().sum() > 0, name

        restart = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]] * 2)
        with pytest.raises(NotImplementedError, match="packed sequences"):
            model(ids, position_ids=restart)
        return errors, loss_error

    errors, loss_error = run_distributed(body, 1, timeout=120)[0]
    assert max(errors) <= TOLERANCE, errors
    assert loss_error <= TOLERANCE


def test_tensor_parallel_logits_and_loss(reference, run_distributed, model_parallel):
    directory, ids, expected = reference

    def body():
        import torch.distributed as dist

        groups = model_parallel(2)
        model = import_nemotron_h(directory, pg_collection=groups)
        mixer = model.decoder.layers[0].mixer
        assert mixer.in_proj.weight.shape[0] == (2 * 64 + 2 * 32 + 8) // 2  # [z; x; B; C; dt] / tp
        with torch.no_grad():
            local = model(ids)
            shards = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(shards, local, group=groups.tp)
            labels = torch.roll(ids, -1, dims=1)
            loss = model(ids, labels=labels)
        return torch.cat(shards, dim=-1), loss

    labels = torch.roll(ids, -1, dims=1)
    reference_loss = F.cross_entropy(expected.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    for logits, loss in run_distributed(body, 2, timeout=120):
        assert (logits - expected).abs().max().item() <= TOLERANCE
        assert (loss - reference_loss.view_as(labels)).abs().max().item() <= TOLERANCE


def test_time_step_limit_is_ignored_as_transformers_does(run_distributed, model_parallel):
    """transformers' NemotronH clamps the time steps at ``time_step_min`` and at no upper limit,
    whatever ``time_step_limit`` says: imported with a finite one, the mixers have no upper clamp
    and the logits equal transformers' where time steps exceed that limit."""
    changes = {"time_step_limit": (0.05, 0.5)}

    def hf_model():
        model = _hf_model(**changes)
        with torch.no_grad():
            model.model.layers[0].mixer.dt_bias[1::2] = 2.0  # softplus(2) = 2.1 > 0.5
        return model

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model()(ids).logits

    def body():
        model = import_nemotron_h(hf_model(), pg_collection=model_parallel(1))
        with torch.no_grad():
            return model.decoder.layers[0].mixer.mamba.mamba_dt_clamp_max, model(ids)

    clamp_max, logits = run_distributed(body, 1, timeout=60)[0]
    assert (logits - expected).abs().max().item() <= TOLERANCE
    assert clamp_max is None


def test_pattern_must_match_num_layers():
    config = TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ConfigError, match="num_layers"):
        HybridModel(config, VOCAB, "M*-E")


def test_moe_layers_need_experts():
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ConfigError, match="num_moe_experts"):
        HybridModel(config, VOCAB, "M*-E")


def test_legacy_config_names_are_read():
    legacy = {k: v for k, v in HF_CONFIG.items() if k not in ("n_groups", "chunk_size")}
    config, mamba, pattern, vocab = nemotron_h_configs(legacy | {"mamba_n_groups": 4, "mamba_chunk_size": 16})
    assert (mamba.mamba_num_groups, mamba.mamba_chunk_size) == (4, 16)
    assert (pattern.symbols, vocab, config.num_moe_experts) == (PATTERN, VOCAB, 4)


UNSUPPORTED = [
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
    ({"moe_latent_size": 16}, "moe_latent_size=16"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"n_group": 2, "topk_group": 1}, "n_group/topk_group"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"layers_block_type": ["mamba", "cross_attention"]}, "layers_block_type"),
]


def test_unsupported_hf_options_fail_before_weights_are_read(tmp_path, run_distributed, model_parallel):
    def body():
        groups = model_parallel(1)
        for index, (change, match) in enumerate(UNSUPPORTED):
            directory = tmp_path / str(index)
            directory.mkdir()
            hf_config = HF_CONFIG | {"model_type": "nemotron_h"} | change
            (directory / "config.json").write_text(json.dumps(hf_config))  # no weights to read
            with pytest.raises(NotImplementedError, match=match):
                import_nemotron_h(directory, pg_collection=groups)

    run_distributed(body, 1, timeout=60)


def test_pipeline_stages_build_their_layers(run_distributed, model_parallel):
    def body():
        groups = model_parallel(1, pipeline_model_parallel_size=2)
        config = TransformerConfig(
            num_layers=4,
            hidden_size=32,
            num_attention_heads=4,
            num_moe_experts=2,
            add_bias_linear=False,
            pipeline_model_parallel_size=2,
        )
        mamba = MambaConfig(mamba_num_heads=8, mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16)
        model = HybridModel(config, VOCAB, "M*|-E", mamba, pg_collection=groups, pre_process=False)
        uneven = HybridModel(config, VOCAB, "M*-|E", mamba, pg_collection=groups, pre_process=False)
        # without "|", the stages take equal shares of the layers
        even = HybridModel(config, VOCAB, "M*-E", mamba, pg_collection=groups, pre_process=False)
        return [
            [(layer.layer_number, layer.layer_type) for layer in m.decoder.layers]
            for m in (model, uneven, even)
        ]

    first_stage, second_stage = run_distributed(body, 2, timeout=60)
    assert first_stage == [
        [(1, "mamba"), (2, "attention")],
        [(1, "mamba"), (2, "attention"), (3, "mlp")],
        [(1, "mamba"), (2, "attention")],
    ]
    assert second_stage == [[(3, "mlp"), (4, "moe")], [(4, "moe")], [(3, "mlp"), (4, "moe")]]
