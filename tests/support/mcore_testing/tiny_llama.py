"""The small Llama-style ``TransformerConfig`` tests build random models from."""

from mcore_models import TransformerConfig

TINY_LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=48,
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def tiny_llama_config(**overrides) -> TransformerConfig:
    """Two layers of grouped-query attention, RMSNorm, SwiGLU and RoPE, no biases, no dropout;
    ``overrides`` replace or add fields."""
    return TransformerConfig(**(TINY_LLAMA | overrides))
