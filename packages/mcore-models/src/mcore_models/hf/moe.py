"""What the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) add to their dense bases: router and
expert config fields, and the per-expert weights."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..config.transformer_config import TransformerConfig
from .mapping import unsupported

# Where configs keep the expert count (transformers maps one name onto the other for some families).
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


class MoEMapping:
    """Mapping mixin, placed before a dense family's mapping. ``block``: the HF layer sub-module
    holding router and experts; ``expert_names``: HF names of an expert's gate, up and down
    projections; ``has_shared_expert``: Qwen2-MoE's gated shared expert."""

    block: ClassVar[str] = "mlp."
    expert_names: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    has_shared_expert: ClassVar[bool] = False
    has_moe_layers: ClassVar[bool] = True
    experts_key: ClassVar[str] = "num_experts"

    # -- config --------------------------------------------------------------------------------
    def moe_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The MoE ``TransformerConfig`` fields; unsupported layouts raise before any weight is read."""
        if hf.get("decoder_sparse_step", 1) != 1:
            raise unsupported("decoder_sparse_step", hf["decoder_sparse_step"], "1 (every layer MoE)")
        if hf.get("mlp_only_layers"):
            raise unsupported("mlp_only_layers", hf["mlp_only_layers"], "[] (every layer MoE)")
        normalize = hf.get("norm_topk_prob", True)
        experts = next((hf[k] for k in (self.experts_key, *_EXPERT_COUNT_KEYS) if hf.get(k)), None)
        if experts is None:
            raise unsupported("num_experts", None, "a positive expert count")
        kwargs = {
            "num_moe_experts": experts,
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
            "moe_router_score_function": "softmax",
            # softmax over the top-k logits == softmax over all, then renormalized over the top k
            "moe_router_pre_softmax": not normalize,
        }
        if hf.get("router_jitter_noise"):
            kwargs["moe_input_jitter_eps"] = hf["router_jitter_noise"]
        if self.has_shared_expert and hf.get("shared_expert_intermediate_size"):
            kwargs["moe_shared_expert_intermediate_size"] = hf["shared_expert_intermediate_size"]
            kwargs["moe_shared_expert_gate"] = True
        return kwargs

    def config_from_hf(self, hf: dict[str, Any]) -> tuple[dict[str, Any], int]:
        moe = self.moe_from_hf(hf)
        kwargs, vocab = super().config_from_hf(hf)
        return kwargs | moe, vocab

    def config_to_hf(self, config: TransformerConfig, vocab_size: int) -> dict[str, Any]:
        if config.num_moe_experts is None:
            raise ValueError(f"{self.model_type} export needs MoE layers (num_moe_experts)")
        if config.moe_router_score_function != "softmax" or config.moe_router_enable_expert_bias:
            raise ValueError(f"{self.model_type} routes by softmax without expert bias")
        if config.moe_router_num_groups is not None or config.moe_expert_capacity_factor is not None:
            raise ValueError(f"{self.model_type} has no group-limited routing and no expert capacity")
        shared = config.moe_shared_expert_intermediate_size
        if shared is not None and not (self.has_shared_expert and config.moe_shared_expert_gate):
            raise ValueError(f"{self.model_type} has no (ungated) shared expert")
        hf = super().config_to_hf(config, vocab_size)
        hf |= {
            self.experts_key: config.num_moe_experts,
            "num_experts_per_tok": config.moe_router_topk,
            "router_jitter_noise": config.moe_input_jitter_eps or 0.0,
        }
        if self.block == "mlp.":
            hf |= {
                "moe_intermediate_size": config.moe_ffn_hidden_size,
                "norm_topk_prob": not config.moe_router_pre_softmax,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
            }
        else:
            if config.moe_router_pre_softmax:
                raise ValueError(f"{self.model_type} renormalizes the top-k probabilities (post-softmax)")
            hf["intermediate_size"] = config.moe_ffn_hidden_size
        if self.has_shared_expert:
            hf["shared_expert_intermediate_size"] = shared or 0
        return hf

    # -- weights -------------------------------------------------------------------------------
    def _expert_weights(self, weights: dict[str, torch.Tensor], prefix: str, experts: int):
        """``(fc1 [E, 2f, h], fc2 [E, h, f])`` from per-expert tensors or fused HF v5 tensors."""
        if f"{prefix}experts.gate_up_proj" in weights:
            return weights[f"{prefix}experts.gate_up_proj"], weights[f"{prefix}experts.down_proj"]
        gate, up, down = self.expert_names
        fc1 = torch.stack(
            [
                torch.cat(
                    (
                        weights[f"{prefix}experts.{e}.{gate}.weight"],
                        weights[f"{prefix}experts.{e}.{up}.weight"],
                    )
                )
                for e in range(experts)
            ]
        )
        fc2 = torch.stack([weights[f"{prefix}experts.{e}.{down}.weight"] for e in range(experts)])
        return fc1, fc2

    def state_from_hf(
        self, weights: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        state = super().state_from_hf(weights, config)
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{self.block}"
            state[f"{ours}router.weight"] = weights[f"{theirs}gate.weight"]
            fc1, fc2 = self._expert_weights(weights, theirs, config.num_moe_experts)
            if config.moe_grouped_gemm:
                state[f"{ours}experts.weight1"], state[f"{ours}experts.weight2"] = fc1, fc2
            else:
                for e in range(config.num_moe_experts):
                    state[f"{ours}experts.local_experts.{e}.linear_fc1.weight"] = fc1[e]
                    state[f"{ours}experts.local_experts.{e}.linear_fc2.weight"] = fc2[e]
            if config.moe_shared_expert_intermediate_size is not None:
                shared = f"{theirs}shared_expert."
                state[f"{ours}shared_experts.linear_fc1.weight"] = torch.cat(
                    (weights[f"{shared}gate_proj.weight"], weights[f"{shared}up_proj.weight"])
                )
                state[f"{ours}shared_experts.linear_fc2.weight"] = weights[f"{shared}down_proj.weight"]
                state[f"{ours}shared_experts.gate_weight"] = weights[f"{theirs}shared_expert_gate.weight"]
        return state

    def state_to_hf(
        self, state: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        weights = super().state_to_hf(state, config)
        gate, up, down = self.expert_names
        for i in range(config.num_layers):
            ours, theirs = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{self.block}"
            weights[f"{theirs}gate.weight"] = state[f"{ours}router.weight"]
            for e in range(config.num_moe_experts):
                if config.moe_grouped_gemm:
                    fc1, fc2 = state[f"{ours}experts.weight1"][e], state[f"{ours}experts.weight2"][e]
                else:
                    fc1 = state[f"{ours}experts.local_experts.{e}.linear_fc1.weight"]
                    fc2 = state[f"{ours}experts.local_experts.{e}.linear_fc2.weight"]
                weights[f"{theirs}experts.{e}.{gate}.weight"], weights[f"{theirs}experts.{e}.{up}.weight"] = (
                    fc1.chunk(2)
                )
                weights[f"{theirs}experts.{e}.{down}.weight"] = fc2
            if config.moe_shared_expert_intermediate_size is not None:
                shared = f"{theirs}shared_expert."
                fc1 = state[f"{ours}shared_experts.linear_fc1.weight"]
                weights[f"{shared}gate_proj.weight"], weights[f"{shared}up_proj.weight"] = fc1.chunk(2)
                weights[f"{shared}down_proj.weight"] = state[f"{ours}shared_experts.linear_fc2.weight"]
                weights[f"{theirs}shared_expert_gate.weight"] = state[f"{ours}shared_experts.gate_weight"]
        return weights
