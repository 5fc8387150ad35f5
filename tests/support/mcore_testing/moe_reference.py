"""Plain-PyTorch oracles for the MoE tests: a config maker and a token-by-token MoE forward."""

import torch
import torch.nn.functional as F
from mcore_models import TransformerConfig

SHAPE = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2}


def moe_config(**overrides) -> TransformerConfig:
    """A small MoE config: 4 experts of width 8, top-2, SwiGLU, no biases."""
    options = {
        "num_moe_experts": 4,
        "moe_ffn_hidden_size": 8,
        "moe_router_topk": 2,
        "activation": "swiglu",
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    return TransformerConfig(**SHAPE | options | overrides)


def expert_forward(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert with Linear-layout weights ``fc1 [2f, h]`` (gate rows first), ``fc2 [h, f]``."""
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ fc2.T


def reference_moe(x: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, experts) -> torch.Tensor:
    """``sum_j probs[t, j] * expert_{indices[t, j]}(x_t)``, one token and one choice at a time.

    ``experts``: a list of ``(fc1, fc2)`` weight pairs.
    """
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            fc1, fc2 = experts[int(indices[t, j])]
            out[t] = out[t] + probs[t, j] * expert_forward(x[t : t + 1], fc1, fc2)[0]
    return out


def expert_weights(experts_module):
    """``(fc1, fc2)`` per expert of a ``SequentialExperts``."""
    return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts_module.local_experts]


def expert_parallel_state(full_state: dict, first: int, local: int) -> dict:
    """The state dict of an expert-parallel rank holding experts ``first .. first + local - 1``,
    from the one-process ``full_state`` (sequential ``local_experts.{e}`` or grouped stacked weights)."""
    state = {}
    for key, value in full_state.items():
        if ".experts.local_experts." in f".{key}":
            head, rest = f".{key}".split(".experts.local_experts.", 1)
            index, tail = rest.split(".", 1)
            if first <= int(index) < first + local:
                state[f"{head}.experts.local_experts.{int(index) - first}.{tail}"[1:]] = value
        elif ".experts." in f".{key}":
            state[key] = value[first : first + local]
        else:
            state[key] = value
    return state
