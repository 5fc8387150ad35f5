"""The tiny NemotronH the hybrid-model tests build with transformers: every layer type's sizes,
small enough for a test, with grouped Mamba heads and scan chunks shorter than the prompts.

Tests add ``vocab_size``, the layer pattern and whatever they need to vary."""

TINY_NEMOTRON_H = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=2,
    ssm_state_size=16,
    chunk_size=8,
    time_step_min=0.05,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
)
