"""RoPE settings between HF ``rope_parameters`` (or legacy ``rope_theta``/``rope_scaling``) and the config."""

from __future__ import annotations

from typing import Any

from ..config.transformer_config import TransformerConfig
from .mapping import unsupported


def rope_from_hf(hf: dict[str, Any], *, partial_rotary: bool = False) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments for the rotary embedding of an HF config.
    ``partial_rotary``: the family's model reads ``partial_rotary_factor`` (else one other than 1
    is refused, since transformers would ignore it)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and not partial_rotary:
        raise unsupported("partial_rotary_factor", partial, "1.0")
    out: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": theta, "rotary_percent": partial}
    if rope_type == "default":
        return out
    if rope_type == "linear":
        return out | {"rope_scaling_type": "linear", "rope_scaling_factor": float(params["factor"])}
    if rope_type == "llama3":
        return out | {
            "rope_scaling_type": "llama3",
            "rope_scaling_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        }
    if rope_type == "yarn":
        if params.get("attention_factor") is not None:
            raise unsupported("rope_parameters.attention_factor", params["attention_factor"], "unset")
        original = params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
        factor = params.get("factor") or hf["max_position_embeddings"] / original
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if not (mscale and mscale_all_dim):  # HF then uses the plain 0.1 ln(factor) + 1 temperature
            mscale, mscale_all_dim = 1.0, 0.0
        return out | {
            "position_embedding_type": "yarn",
            "yarn_rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_mscale": float(mscale),
            "yarn_mscale_all_dim": float(mscale_all_dim),
            "yarn_correction_range_round_to_int": bool(params.get("truncate", True)),
        }
    raise unsupported("rope_type", rope_type, "default, linear, llama3, yarn")


def rope_to_hf(config: TransformerConfig, *, partial_rotary: bool = False) -> dict[str, Any]:
    """``rope_theta`` and ``rope_parameters`` entries of an HF config (``ValueError`` for a
    ``rotary_percent`` other than 1 unless the family reads ``partial_rotary``)."""
    params: dict[str, Any] = {"rope_theta": config.rotary_base, "rope_type": "default"}
    if config.position_embedding_type == "yarn":
        params |= {
            "rope_type": "yarn",
            "factor": config.yarn_rotary_scaling_factor,
            "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
            "beta_fast": config.yarn_beta_fast,
            "beta_slow": config.yarn_beta_slow,
            "truncate": config.yarn_correction_range_round_to_int,
        }
        if config.yarn_mscale_all_dim:
            params |= {"mscale": config.yarn_mscale, "mscale_all_dim": config.yarn_mscale_all_dim}
        elif config.yarn_mscale != 1.0:
            raise ValueError("yarn_mscale != 1 with yarn_mscale_all_dim = 0 has no Hugging Face equivalent")
    elif config.rope_scaling_type == "linear":
        params |= {"rope_type": "linear", "factor": config.rope_scaling_factor}
    elif config.rope_scaling_type == "llama3":
        params |= {
            "rope_type": "llama3",
            "factor": config.rope_scaling_factor,
            "low_freq_factor": config.rope_low_freq_factor,
            "high_freq_factor": config.rope_high_freq_factor,
            "original_max_position_embeddings": config.rope_original_max_position_embeddings,
        }
    if config.rotary_percent != 1.0:
        if not partial_rotary:
            raise ValueError(f"rotary_percent={config.rotary_percent} has no equivalent in this family")
        params["partial_rotary_factor"] = config.rotary_percent
    return {"rope_theta": config.rotary_base, "rope_parameters": params}
