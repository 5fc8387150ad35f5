"""What a Hugging Face model family mapping provides."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..config.transformer_config import TransformerConfig


class HFMapping:
    """Converts one HF ``model_type`` to and from ``GPTModel``: config and full (TP=1) state dicts.

    Subclasses set ``model_type`` and ``architecture`` and implement the four conversions.
    ``special_token_defaults`` holds the ``bos_token_id``/``eos_token_id``/``pad_token_id`` that
    ``transformers`` assumes for the family when ``config.json`` omits them (absent: ``None``).
    ``has_moe_layers``: the family's MLPs are mixtures of experts.
    """

    model_type: ClassVar[str]
    architecture: ClassVar[str]
    special_token_defaults: ClassVar[dict[str, Any]] = {}
    has_moe_layers: ClassVar[bool] = False

    def check_mlp_kind(self, config: TransformerConfig) -> None:
        """``ValueError`` for an MoE model in a dense family (export would drop its experts)."""
        if config.num_moe_experts is not None and not self.has_moe_layers:
            raise ValueError(
                f"{self.model_type} has dense MLPs; export a model with MoE layers as mixtral, "
                "qwen2_moe, qwen3_moe or gpt_oss"
            )

    def config_from_hf(self, hf: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """``TransformerConfig`` keyword arguments and the vocabulary size of an HF ``config.json``."""
        raise NotImplementedError

    def config_to_hf(self, config: TransformerConfig, vocab_size: int) -> dict[str, Any]:
        """The HF ``config.json`` contents (without ``architectures``/``model_type``)."""
        raise NotImplementedError

    def state_from_hf(
        self, weights: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        """HF tensors -> the full state dict of ``GPTModel``."""
        raise NotImplementedError

    def state_to_hf(
        self, state: dict[str, torch.Tensor], config: TransformerConfig
    ) -> dict[str, torch.Tensor]:
        """The full state dict of ``GPTModel`` -> HF tensors (tied output weight omitted)."""
        raise NotImplementedError


def unsupported(field: str, value: Any, allowed: str) -> NotImplementedError:
    """The error for an HF config value this mapping cannot represent."""
    return NotImplementedError(
        f"Hugging Face config {field}={value!r} is not supported; supported: {allowed}"
    )
