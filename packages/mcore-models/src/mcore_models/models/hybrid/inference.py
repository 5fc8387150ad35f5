"""How a hybrid model's layers meet an inference engine: the Mamba state the engine keeps for them
(``mamba_state_config``) and a Mamba layer's step over the engine's state slots
(``mamba_inference_forward``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...ssm import MambaMixer
from ...transformer.inference_context import InferenceContext, MambaInferenceContext
from ...transformer.inference_model import MambaInferenceStateConfig


def mamba_state_config(layers: Sequence[torch.nn.Module]) -> MambaInferenceStateConfig | None:
    """The state of the ``HybridLayer``s ``layers`` (one stage's, consecutive), or ``None`` when
    none is a Mamba layer. The SSM state is float32 (as ``MambaMixer`` keeps it), the conv state
    in the dtype of the mixer's weights."""
    mixers = [layer.mixer for layer in layers if layer.layer_type == "mamba"]
    if not mixers:
        return None
    conv, ssm = mixers[0].state_shapes(1)
    numbers = [layer.layer_number for layer in layers]
    return MambaInferenceStateConfig(
        range(numbers[0], numbers[-1] + 1),
        tuple(layer.layer_type for layer in layers),
        conv[1:],
        ssm[1:],
        mixers[0].conv1d.weight.dtype,
        torch.float32,
    )


def mamba_inference_forward(
    mixer: MambaMixer, hidden_states: torch.Tensor, inference_context: InferenceContext
) -> torch.Tensor:
    """``mixer`` over one engine step ``[t, 1, h]``, continuing each request's state in the
    context's slots (``MambaMixer.paged_forward``).

    Raises:
        TypeError: the context keeps no Mamba states (it is not a ``MambaInferenceContext``).
    """
    if not isinstance(inference_context, MambaInferenceContext):
        raise TypeError(
            f"a Mamba layer needs an inference context that keeps Mamba states (MambaInferenceContext: "
            f"mamba_states, mamba_layout); {type(inference_context).__name__} does not"
        )
    conv_states, ssm_states = inference_context.mamba_states(mixer.layer_number)
    return mixer.paged_forward(hidden_states, conv_states, ssm_states, inference_context.mamba_layout)
