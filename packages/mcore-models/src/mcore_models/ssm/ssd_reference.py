"""The selective SSM recurrence of Mamba-2, one timestep at a time: the numerical oracle of the
chunked SSD scan. Slow by design; it exists to be obviously right."""

from __future__ import annotations

import torch
from mcore_api import experimental_api

from ._shapes import check_sequence_inputs


@experimental_api
def ssd_naive_recurrence(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t ⊗ B_t``, ``y_t = h_t · C_t + D * x_t``, looped
    over ``t`` in the inputs' own (promoted) dtype; pass float64 for an exact reference.

    Same shapes and meaning as :func:`~mcore_models.ssm.ssd_scan.ssd_chunked_scan` (which takes a
    ``chunk_size`` besides): returns ``y`` ``[batch, seqlen, nheads, headdim]``, and with
    ``return_final_state`` the state ``[batch, nheads, headdim, dstate]`` after the last token.
    """
    dims = check_sequence_inputs(x, dt, A, B, C, D, initial_state)
    group_of_head = torch.arange(dims.nheads, device=x.device) // dims.heads_per_group
    B_per_head = B[:, :, group_of_head]  # [batch, seqlen, nheads, dstate]
    C_per_head = C[:, :, group_of_head]
    if initial_state is None:
        state = x.new_zeros(dims.batch, dims.nheads, dims.headdim, dims.dstate)
    else:
        state = initial_state
    outputs = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)  # [batch, nheads]
        update = (dt[:, t, :, None] * x[:, t])[..., :, None] * B_per_head[:, t, :, None, :]
        state = decay[..., None, None] * state + update
        y_t = (state * C_per_head[:, t, :, None, :]).sum(dim=-1)
        if D is not None:
            y_t = y_t + D[:, None] * x[:, t]
        outputs.append(y_t)
    y = torch.stack(outputs, dim=1)
    if return_final_state:
        return y, state
    return y
