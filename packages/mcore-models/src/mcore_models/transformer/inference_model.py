"""What an inference engine may use of a model: the counterpart of ``InferenceContext``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from .inference_context import InferenceContext


@dataclass(frozen=True)
class KVCacheSpec:
    """The key/value cache that a model's layers on this rank need.

    ``layer_numbers``: the 1-based global numbers of this rank's layers, consecutive
    (``range(first, last + 1)``); they are what ``InferenceContext.attend`` receives.
    ``num_kv_heads``: the key/value heads of this tensor-parallel rank; ``head_dim``: their width.
    ``dtype``, ``device``: those of the model's activations, which the cache stores and pipeline
    stages exchange.
    """

    layer_numbers: range
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        layers = self.layer_numbers
        if not isinstance(layers, range) or layers.step != 1 or not layers or layers.start < 1:
            raise ValueError(
                f"layer_numbers must be a non-empty range(first, stop) with first >= 1, got {layers!r}"
            )
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class MambaInferenceStateConfig:
    """The per-request state that the Mamba layers of a hybrid model on this rank keep while
    generating, beside the key/value cache of its attention layers.

    ``layer_types``: the type of each layer of ``layer_numbers`` (this rank's layers, as
    ``KVCacheSpec.layer_numbers``): ``"mamba"``, ``"attention"``, ``"mlp"`` or ``"moe"``.
    ``conv_state_shape`` ``(channels, kernel_width - 1)`` and ``ssm_state_shape``
    ``(heads, head_dim, state_dim)``: one request's state in one Mamba layer, this
    tensor-parallel rank's channels and heads; ``conv_dtype``, ``ssm_dtype``: their dtypes.
    """

    layer_numbers: range
    layer_types: tuple[str, ...]
    conv_state_shape: tuple[int, int]
    ssm_state_shape: tuple[int, int, int]
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    def __post_init__(self) -> None:
        if len(self.layer_types) != len(self.layer_numbers) or "mamba" not in self.layer_types:
            raise ValueError(
                f"layer_types must name one type per layer of {self.layer_numbers!r}, at least one "
                f"'mamba', got {self.layer_types!r}"
            )
        for name, rank in (("conv_state_shape", 2), ("ssm_state_shape", 3)):
            shape = getattr(self, name)
            if len(shape) != rank or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
            ):
                raise ValueError(f"{name} must be {rank} ints >= 0, got {shape!r}")

    def layers_of_type(self, layer_type: str) -> tuple[int, ...]:
        """The 1-based global numbers of the layers of ``layer_type`` among ``layer_numbers``."""
        return tuple(
            n for n, kind in zip(self.layer_numbers, self.layer_types, strict=True) if kind == layer_type
        )

    def state_bytes(self) -> int:
        """Bytes of one request's states over all Mamba layers."""
        conv = math.prod(self.conv_state_shape) * torch.empty((), dtype=self.conv_dtype).element_size()
        ssm = math.prod(self.ssm_state_shape) * torch.empty((), dtype=self.ssm_dtype).element_size()
        return len(self.layers_of_type("mamba")) * (conv + ssm)


@runtime_checkable
class InferenceModel(Protocol):
    """Everything an inference engine may use of a model; ``GPTModel`` implements it.

    An engine reads these members and calls ``inference_forward``, nothing else, and never sets
    an attribute of the model or switches its mode. The model may be one stage of a pipeline:
    the first stage (``pre_process``) embeds token ids, the last (``post_process``) produces
    logits, and every later stage takes the hidden states of the stage before it.

    Optional member (read through ``mamba_state_config_of``, so models without it keep working):
    ``mamba_state_config``, a ``MambaInferenceStateConfig`` or ``None``, for a model with Mamba
    layers on this rank; its ``inference_forward`` is then given a ``MambaInferenceContext``.
    """

    vocab_size: int
    """Width of the logits; token ids are in ``[0, vocab_size)``."""

    hidden_size: int
    """Width of the hidden states ``[t, 1, hidden_size]`` passed between pipeline stages."""

    max_sequence_length: int | None
    """The most positions the model can encode (learned position embeddings), or ``None``."""

    eos_token_ids: tuple[int, ...]
    """End-of-sequence ids at which generation stops by default (empty: none)."""

    pre_process: bool
    """Whether this is the first pipeline stage (it embeds ``input_ids``)."""

    post_process: bool
    """Whether this is the last pipeline stage (it returns logits)."""

    tp_group: dist.ProcessGroup | None
    """The tensor-parallel group, whose ranks run every forward together (``None``: not split)."""

    training: bool
    """Training mode; an engine refuses a model in training mode instead of switching it."""

    kv_cache_spec: KVCacheSpec
    """The cache this rank's layers need."""

    def inference_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        inference_context: InferenceContext,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One engine step over the flattened row ``input_ids``, ``position_ids`` ``[1, t]``.

        ``hidden_states [t, 1, hidden_size]`` come from the previous stage on a stage without
        ``pre_process`` (``None`` on the first stage). Returns, on the last stage, the logits
        ``[k, vocab_size]`` of the rows ``inference_context.logits_indices`` over the full
        vocabulary (the same on every tensor-parallel rank), else the hidden states
        ``[t, 1, hidden_size]``. Applies no dropout and changes nothing in the model.
        """
        ...


def missing_inference_members(model: object) -> list[str]:
    """The members of ``InferenceModel`` that ``model`` lacks (empty when it has them all)."""
    methods = [name for name, value in vars(InferenceModel).items() if callable(value) and name[0] != "_"]
    return [name for name in (*InferenceModel.__annotations__, *methods) if not hasattr(model, name)]


OPTIONAL_INFERENCE_MEMBERS = ("mamba_state_config",)
"""Members of ``InferenceModel`` that a model may lack; an engine reads them through
``mamba_state_config_of``."""


def mamba_state_config_of(model: object) -> MambaInferenceStateConfig | None:
    """The optional ``mamba_state_config`` of ``model``: ``None`` when it has none (no Mamba
    layers on this rank, or a model implementing only the members of ``InferenceModel``).

    Raises:
        TypeError: the member is there but not a ``MambaInferenceStateConfig`` or ``None``.
    """
    config = getattr(model, "mamba_state_config", None)
    if config is not None and not isinstance(config, MambaInferenceStateConfig):
        raise TypeError(
            f"model.mamba_state_config must be a MambaInferenceStateConfig or None, got {type(config).__name__}"
        )
    return config
