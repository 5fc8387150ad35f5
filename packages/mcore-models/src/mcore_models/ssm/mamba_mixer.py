"""The Mamba-2 mixer layer: in_proj, causal conv, selective SSM (SSD), gated RMSNorm, out_proj.

Tensor parallelism splits the SSM heads and the B/C groups over ``tp_group``: ``in_proj`` is
column-parallel with rows ``[z; x; B; C; dt]`` (Hugging Face's and Megatron-LM's layout), each
block split separately, so rank ``r`` computes ``[its z; its x; its B; its C; its dt]``; the conv
channels ``[x; B; C]`` likewise; ``dt_bias``, ``A_log``, ``D`` and the norm weight are split per
head; ``out_proj`` is row-parallel. Every parameter is this rank's slice of a master drawn on the
CPU from the default generator, so the layer equals the single-process one at any TP size.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mcore_api import experimental_api
from mcore_kernels import mamba_state_update
from mcore_parallel import ColumnParallelLinear, RowParallelLinear, sharded_parameter

from ..config.transformer_config import TransformerConfig
from ..transformer.inference_context import MambaStepLayout
from ..transformer.init import init_method, output_init_method
from .block_sharding import blockwise_init
from .causal_conv1d_layer import CausalConv1dLayer
from .gated_rms_norm_layer import GatedRMSNormLayer
from .mamba_config import MambaConfig
from .mamba_init import init_a_log, init_dt_bias
from .ssd_scan import ssd_chunked_scan
from .ssd_step import ssd_decode_step


@experimental_api
class MambaMixer(torch.nn.Module):
    """Mamba-2 mixer on ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism).

    Like ``MLP`` and ``SelfAttention``, ``forward`` returns the output tensor alone (the
    projections have no bias, as Megatron-LM's and Hugging Face's defaults). Parameter names and
    full shapes are Hugging Face ``Mamba2Mixer``'s: ``in_proj.weight``, ``conv1d.weight``
    ``[C, 1, K]``, ``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``,
    ``out_proj.weight``; ``in_proj.weight`` and the conv parameters are tagged ``partition_blocks``
    (see ``block_sharding``).

    Decoding: ``prefill`` also returns the states after the sequence, ``step`` advances them by one
    token, ``state_shapes`` gives their per-rank shapes; ``paged_forward`` runs an inference
    engine's step of many requests, each continuing its own state slot. The conv state is kept in the activation
    dtype, the SSM state in float32.

    Raises:
        ConfigError: the sizes of ``mamba`` (default ``MambaConfig()``) do not fit together or
            ``config.hidden_size`` (``MambaConfig.heads``).
        ValueError: the heads or groups do not split over the tensor-parallel ranks.
    """

    def __init__(
        self,
        config: TransformerConfig,
        mamba: MambaConfig | None = None,
        *,
        tp_group: dist.ProcessGroup,
        layer_number: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.mamba = mamba = MambaConfig() if mamba is None else mamba
        self.layer_number = layer_number
        tp_size = dist.get_world_size(tp_group)
        heads, groups = mamba.heads(config.hidden_size), mamba.mamba_num_groups
        for name, value in (("the Mamba heads", heads), ("mamba_num_groups", groups)):
            if value % tp_size:
                raise ValueError(
                    f"{name} ({value}) must be divisible by the tensor-parallel size ({tp_size})"
                )
        self.head_dim, self.state_dim = mamba.mamba_head_dim, mamba.mamba_state_dim
        self.num_heads, self.num_groups = heads // tp_size, groups // tp_size  # on this rank
        inner, bc = heads * self.head_dim, groups * self.state_dim
        local_inner, local_bc = inner // tp_size, bc // tp_size
        self._in_proj_split = [local_inner, local_inner + 2 * local_bc, self.num_heads]  # z, xBC, dt
        self._conv_split = [local_inner, local_bc, local_bc]  # x, B, C
        dtype = config.params_dtype
        linear_options = {"tp_group": tp_group, "bias": False, "sequence_parallel": config.sequence_parallel}
        in_blocks = (inner, inner, bc, bc, heads)
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            sum(in_blocks),
            init_method=blockwise_init(init_method(config), in_blocks, tp_size),
            params_dtype=dtype,
            **linear_options,
        )
        self.in_proj.weight.partition_blocks = in_blocks
        self.conv1d = CausalConv1dLayer(
            (inner, bc, bc),
            mamba.mamba_conv_kernel,
            tp_group=tp_group,
            params_dtype=dtype,
            conv_init=mamba.mamba_conv_init,
        )
        self.dt_bias = sharded_parameter((heads,), 0, tp_group, partial(init_dt_bias, mamba), dtype, None)
        self.A_log = sharded_parameter((heads,), 0, tp_group, partial(init_a_log, mamba), dtype, None)
        self.D = sharded_parameter((heads,), 0, tp_group, torch.nn.init.ones_, dtype, None)
        self.norm = GatedRMSNormLayer(
            inner,
            group_size=inner // groups,
            eps=config.layernorm_epsilon,
            tp_group=tp_group,
            params_dtype=dtype,
        )
        self.out_proj = RowParallelLinear(
            inner,
            config.hidden_size,
            init_method=output_init_method(config),
            params_dtype=dtype,
            **linear_options,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]``."""
        return self.prefill(hidden_states)[0]

    def prefill(
        self,
        hidden_states: torch.Tensor,
        conv_state: torch.Tensor | None = None,
        ssm_state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` from the given states (zeros if ``None``), also returning the states after
        the last token: ``(output [s, b, h], conv_state, ssm_state)`` of ``state_shapes(b)``."""
        self._check_hidden(hidden_states, 3, "[s, b, h]")
        projected, _ = self.in_proj(hidden_states)
        z, xbc, dt = projected.transpose(0, 1).split(self._in_proj_split, dim=-1)  # batch first
        y, conv_state, ssm_state = self._mix_sequence(xbc, dt, conv_state, ssm_state)
        y = self.norm(y.flatten(-2), z).transpose(0, 1)
        return self.out_proj(y)[0], conv_state, ssm_state

    def step(
        self, hidden_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per sequence, ``[b, h]`` or ``[1, b, h]`` -> ``(output of the same shape,
        new conv_state, new ssm_state)``; the given states are left unchanged.

        Raises:
            ValueError: sequence parallelism is on (a step has no sequence to split), or the
                input is not one token.
        """
        if self.config.sequence_parallel:
            raise ValueError(
                "MambaMixer.step needs sequence_parallel off: one token cannot be split over ranks"
            )
        if hidden_states.dim() == 3 and hidden_states.shape[0] == 1:
            token = hidden_states[0]
        else:
            self._check_hidden(hidden_states, 2, "[b, h] or [1, b, h]")
            token = hidden_states
        projected, _ = self.in_proj(token)
        z, xbc, dt = projected.split(self._in_proj_split, dim=-1)
        y, conv_state, ssm_state = self._mix_token(xbc, dt, conv_state, ssm_state)
        output = self.out_proj(self.norm(y.flatten(-2), z))[0]
        return output.view(hidden_states.shape), conv_state, ssm_state

    def paged_forward(
        self,
        hidden_states: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        layout: MambaStepLayout,
    ) -> torch.Tensor:
        """One inference-engine step over a flattened row ``[t, 1, h]`` of several requests'
        tokens -> ``[t, 1, h]``. ``conv_states [slots, ...]`` and ``ssm_states [slots, ...]`` hold
        one row per request of ``state_shapes(1)``; ``layout`` says which rows continue which
        slot: its decode rows advance together by one token each, each prefill segment is scanned
        from its slot's state. The slots are left holding the states after this step's tokens."""
        if self.config.sequence_parallel:
            raise ValueError("MambaMixer.paged_forward needs sequence_parallel off")
        self._check_hidden(hidden_states, 3, "[t, 1, h]")
        if hidden_states.shape[1] != 1:
            raise ValueError(
                f"hidden_states must be one flattened row [t, 1, h]; got {list(hidden_states.shape)}"
            )
        projected, _ = self.in_proj(hidden_states[:, 0])
        z, xbc, dt = projected.split(self._in_proj_split, dim=-1)
        y = xbc.new_empty(xbc.shape[0], self.num_heads, self.head_dim)
        rows, slots = layout.decode_rows, layout.decode_slots
        if rows.numel():
            y[rows] = self._mix_tokens_in_slots(xbc[rows], dt[rows], conv_states, ssm_states, slots)
        for rows, slot in layout.prefills:
            state = slice(slot, slot + 1)
            out, conv, ssm = self._mix_sequence(
                xbc[None, rows], dt[None, rows], conv_states[state], ssm_states[state]
            )
            y[rows], conv_states[state], ssm_states[state] = out[0], conv, ssm.to(ssm_states.dtype)
        return self.out_proj(self.norm(y.flatten(-2), z))[0].unsqueeze(1)

    def state_shapes(self, batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's ``(conv_state, ssm_state)`` shapes for ``batch`` sequences:
        ``[batch, conv channels / tp, kernel - 1]`` and ``[batch, heads / tp, head_dim, state_dim]``."""
        conv = (batch, sum(self._conv_split), self.mamba.mamba_conv_kernel - 1)
        return conv, (batch, self.num_heads, self.head_dim, self.state_dim)

    def _mix_sequence(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_state: torch.Tensor | None,
        ssm_state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv and SSD scan of ``xbc [b, s, C]``, ``dt [b, s, heads]`` from the given states:
        ``(y [b, s, heads, head_dim], conv_state, ssm_state)`` after the last token."""
        xbc, conv_state = self.conv1d(xbc, conv_state)
        y, ssm_state = ssd_chunked_scan(
            *self._ssm_inputs(xbc, dt),
            chunk_size=self.mamba.mamba_chunk_size,
            D=self.D,
            initial_state=ssm_state,
            return_final_state=True,
        )
        return y, conv_state, ssm_state

    def _mix_token(
        self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_mix_sequence`` of one token per sequence, ``xbc [b, C]``, ``dt [b, heads]``."""
        xbc, conv_state = self.conv1d.step(conv_state, xbc)
        y, ssm_state = ssd_decode_step(ssm_state, *self._ssm_inputs(xbc, dt), self.D)
        return y, conv_state, ssm_state

    def _mix_tokens_in_slots(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """``_mix_token`` of ``xbc [b, C]``, ``dt [b, heads]`` continuing the states in rows ``slots``
        of the caches: the SSM states advance in place (``mamba_state_update``, no copy of them)."""
        xbc, conv_states[slots] = self.conv1d.step(conv_states[slots], xbc)
        return mamba_state_update(ssm_states, slots, *self._ssm_inputs(xbc, dt), self.D)

    def _ssm_inputs(self, xbc: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(x, dt, A, B, C)`` of the SSD from the conv output ``xbc [..., C]`` and the raw time
        steps ``dt [..., heads]``: ``x`` by heads, ``B`` and ``C`` by groups, ``dt`` through
        ``_time_steps``, ``A = -exp(A_log)``."""
        x, B, C = xbc.split(self._conv_split, dim=-1)
        return (
            x.unflatten(-1, (self.num_heads, self.head_dim)),
            self._time_steps(dt),
            -torch.exp(self.A_log.float()),
            B.unflatten(-1, (self.num_groups, self.state_dim)),
            C.unflatten(-1, (self.num_groups, self.state_dim)),
        )

    def _time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        """``softplus(dt + dt_bias)`` in float32, at least ``mamba_dt_clamp_min`` and at most
        ``mamba_dt_clamp_max`` (Hugging Face's ``time_step_limit``). Every path (the chunked scan,
        ``prefill``, ``step``, ``paged_forward``) takes its time steps from here."""
        steps = F.softplus(dt.float() + self.dt_bias.float())
        floor, ceiling = self.mamba.mamba_dt_clamp_min, self.mamba.mamba_dt_clamp_max
        if floor > 0 or ceiling is not None:
            steps = steps.clamp(min=floor if floor > 0 else None, max=ceiling)
        return steps

    def _check_hidden(self, hidden_states: torch.Tensor, rank: int, layout: str) -> None:
        if hidden_states.dim() != rank or hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden_states must have shape {layout} with h = hidden_size ({self.config.hidden_size}); "
                f"got {list(hidden_states.shape)}"
            )
