"""Transformer Engine layers behind the interfaces of the local spec. Importing this module imports
Transformer Engine; only ``get_gpt_layer_te_spec`` does, never ``import mcore_models``."""

from __future__ import annotations

import torch
import torch.distributed as dist

try:
    import transformer_engine.pytorch as te
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "the Transformer Engine spec needs transformer_engine: pip install 'mcore-models[te]' on a CUDA machine"
    ) from error

from ..config.transformer_config import TransformerConfig


def _tag(param: torch.nn.Parameter | None, partition_dim: int) -> None:
    if param is not None:
        param.tensor_model_parallel = True
        param.partition_dim = partition_dim


class _TEParallelLinear(te.Linear):
    """``te.Linear`` in ``parallel_mode``; ``forward`` returns ``(output, None)`` like mcore-parallel's linears."""

    parallel_mode: str
    partition_dim: int

    def __init__(
        self,
        input_size,
        output_size,
        *,
        tp_group,
        bias=True,
        sequence_parallel=False,
        init_method=None,
        params_dtype=torch.float32,
        **_,
    ):
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            init_method=init_method,
            sequence_parallel=sequence_parallel,
            tp_group=tp_group,
            tp_size=dist.get_world_size(tp_group),
            parallel_mode=self.parallel_mode,
            params_dtype=params_dtype,
        )
        _tag(self.weight, self.partition_dim)
        if bias and self.partition_dim == 0:
            _tag(getattr(self, "bias", None), 0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


class TEColumnParallelLinear(_TEParallelLinear):
    """Split by output rows (column parallel)."""

    parallel_mode = "column"
    partition_dim = 0


class TERowParallelLinear(_TEParallelLinear):
    """Split by input columns, reduced (or reduce-scattered) over TP (row parallel)."""

    parallel_mode = "row"
    partition_dim = 1


def te_norm(config: TransformerConfig, hidden_size: int, eps: float | None = None) -> torch.nn.Module:
    """``te.RMSNorm`` or ``te.LayerNorm`` as the config asks."""
    cls = te.RMSNorm if config.normalization == "RMSNorm" else te.LayerNorm
    return cls(
        hidden_size,
        eps=config.layernorm_epsilon if eps is None else eps,
        sequence_parallel=config.sequence_parallel,
        params_dtype=config.params_dtype,
    )
