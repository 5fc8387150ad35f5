"""Column- and row-parallel linear layers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import resolve_tp_group
from .initialization import InitMethod, check_divisible, default_init_method, sharded_parameter
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .packed_weight import PackedLinearWeight, linear


class ColumnParallelLinear(torch.nn.Module):
    """``y = x A^T + b`` with ``A`` split along its output rows: each rank computes a slice of ``y``.

    Input ``[s, b, input_size]`` (with ``sequence_parallel``, this rank's ``[s / tp, b, input_size]``
    slice, all-gathered before the matmul). Output ``[s, b, output_size / tp]``, or the full
    ``output_size`` with ``gather_output``. ``forward`` returns ``(output, bias)``: ``bias`` is the
    bias left for the caller to add with ``skip_bias_add``, else ``None``.

    Args:
        tp_group: the tensor-parallel group; ``None`` takes the global one from ``parallel_state``.
        init_method: fills the full master weight; every TP rank must be seeded alike.
        stride: the full weight's output rows form ``stride`` equal blocks (a gated MLP's fc1,
            ``[gate; up]``: 2); each rank holds its slice of every block (see ``sharded_parameter``),
            so its output is ``[its gate columns, its up columns]``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        init_method: InitMethod = default_init_method,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        stride: int = 1,
    ):
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("gather_output and sequence_parallel cannot both be set on ColumnParallelLinear")
        self.tp_group = resolve_tp_group(tp_group)
        tp_size = dist.get_world_size(self.tp_group)
        self._single_rank = tp_size == 1  # a group's size never changes
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = check_divisible("output_size", output_size, tp_size)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.weight = sharded_parameter(
            (output_size, input_size), 0, self.tp_group, init_method, params_dtype, device, stride=stride
        )
        self.bias = (
            sharded_parameter(
                (output_size,), 0, self.tp_group, torch.nn.init.zeros_, params_dtype, device, stride=stride
            )
            if bias
            else None
        )
        self.packed_weight: PackedLinearWeight | None = None  # see ``set_cpu_weight_packing``

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # on one rank every mapping is the identity: their calls are skipped (decode steps are short)
        if self.sequence_parallel and not self._single_rank:
            x = gather_from_sequence_parallel_region(x, self.tp_group, tensor_parallel_output_grad=True)
        elif not self._single_rank:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        output = linear(x, self.weight, self._matmul_bias(), self.packed_weight)
        if self.gather_output and not self._single_rank:
            output = gather_from_tensor_model_parallel_region(output, self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)

    def _matmul_bias(self) -> torch.Tensor | None:
        """The bias the layer's matrix product adds (``None`` when it returns the bias apart)."""
        return None if self.skip_bias_add else self.bias

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"per_partition={self.output_size_per_partition}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(torch.nn.Module):
    """``y = x A^T + b`` with ``A`` split along its input columns: each rank adds a partial ``y``.

    Input ``[s, b, input_size / tp]`` (or the full input, scattered first, when
    ``input_is_parallel=False``). The partial products are all-reduced into ``[s, b, output_size]``,
    or with ``sequence_parallel`` reduce-scattered into this rank's ``[s / tp, b, output_size]``.
    The bias is added after the reduction; under sequence parallelism it sees only this rank's
    tokens, so it is tagged ``sequence_parallel = True`` and its gradient must be summed over the
    TP group (``reduce_sequence_parallel_grads``). ``forward`` returns ``(output, bias)`` like
    ``ColumnParallelLinear``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        init_method: InitMethod = default_init_method,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True on RowParallelLinear")
        self.tp_group = resolve_tp_group(tp_group)
        tp_size = dist.get_world_size(self.tp_group)
        self._single_rank = tp_size == 1  # a group's size never changes
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = check_divisible("input_size", input_size, tp_size)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.weight = sharded_parameter(
            (output_size, input_size), 1, self.tp_group, init_method, params_dtype, device
        )
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.bias = None
        self.packed_weight: PackedLinearWeight | None = None  # see ``set_cpu_weight_packing``

    def _matmul_bias(self) -> None:
        """The bias the layer's matrix product adds: none (it is added after the reduction)."""
        return None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel and not self._single_rank:  # one rank: mappings are identities
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        output = linear(x, self.weight, self._matmul_bias(), self.packed_weight)
        if self.sequence_parallel and not self._single_rank:
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        elif not self._single_rank:
            output = reduce_from_tensor_model_parallel_region(output, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        return output + self.bias, None

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, "
            f"per_partition={self.input_size_per_partition}, sequence_parallel={self.sequence_parallel}"
        )
