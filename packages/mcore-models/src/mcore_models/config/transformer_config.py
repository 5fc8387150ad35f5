"""``TransformerConfig``: the shape and behaviour of a transformer, one declared field per option."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_parallel import ConfigError, ModelParallelConfig, config_field

GATED_ACTIVATIONS = ("swiglu", "geglu", "quick_geglu")


@dataclass(kw_only=True)
class TransformerConfig(ModelParallelConfig):
    """Transformer: layers, widths, attention variants, position embeddings, MLP and recompute."""

    # -- shape -------------------------------------------------------------------------------
    num_layers: int = config_field(minimum=1, help="Number of transformer layers.")
    hidden_size: int = config_field(minimum=1, help="Width of the residual stream.")
    num_attention_heads: int = config_field(minimum=1, help="Query heads per attention layer.")
    num_query_groups: int | None = config_field(
        None, minimum=1, help="Key/value heads (GQA; 1 is MQA). Default: num_attention_heads."
    )
    ffn_hidden_size: int | None = config_field(
        None, minimum=1, help="Width of the MLP's hidden layer. Default: 4 * hidden_size."
    )
    kv_channels: int | None = config_field(
        None, minimum=1, help="Width of one attention head. Default: hidden_size / num_attention_heads."
    )
    # -- normalization -----------------------------------------------------------------------
    normalization: Literal["LayerNorm", "RMSNorm"] = config_field(
        "LayerNorm", help="Normalization layer type."
    )
    layernorm_epsilon: float = config_field(1e-5, minimum=0.0, help="Epsilon of the normalization layers.")
    qk_layernorm: bool = config_field(False, help="Normalize queries and keys per head before RoPE.")
    # -- biases and activation ---------------------------------------------------------------
    add_bias_linear: bool = config_field(True, help="Biases in all linear layers.")
    add_qkv_bias: bool = config_field(
        False, help="Bias in the QKV projection only (on whenever add_bias_linear is)."
    )
    activation: Literal[
        "gelu", "gelu_tanh", "relu", "squared_relu", "silu", "swiglu", "geglu", "quick_geglu"
    ] = config_field(
        "gelu", help="MLP activation; swiglu, geglu and quick_geglu are gated (fc1 twice as wide)."
    )
    glu_linear_offset: float = config_field(
        0.0, help="Added to the linear half of gated activations: act(gate) * (up + offset)."
    )
    quick_gelu_alpha: float = config_field(
        1.702, help="Slope of quick_geglu's sigmoid: x * sigmoid(alpha x)."
    )
    activation_clamp_value: float | None = config_field(
        None, minimum=0.0, help="Clamp gated-activation inputs: gate <= value, |up| <= value."
    )
    # -- position embeddings -----------------------------------------------------------------
    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = config_field(
        "learned_absolute", help="How positions enter the model."
    )
    max_position_embeddings: int = config_field(
        2048, minimum=1, help="Rows of the learned position table; longest sequence for learned positions."
    )
    rotary_base: float = config_field(10000.0, minimum=1.0, help="RoPE base (theta).")
    rotary_percent: float = config_field(
        1.0,
        minimum=0.0,
        help="Fraction of each head's channels RoPE rotates (the first ones); the rest pass through.",
    )
    rope_scaling_type: Literal["none", "linear", "llama3"] = config_field(
        "none", help="Frequency scaling of plain RoPE: linear (position interpolation) or llama3."
    )
    rope_scaling_factor: float = config_field(
        1.0, minimum=1.0, help="Context extension factor of RoPE scaling."
    )
    rope_low_freq_factor: float = config_field(1.0, help="llama3 scaling: low-frequency factor.")
    rope_high_freq_factor: float = config_field(4.0, help="llama3 scaling: high-frequency factor.")
    rope_original_max_position_embeddings: int = config_field(
        8192, minimum=1, help="llama3 scaling: context length the model was trained at."
    )
    yarn_rotary_scaling_factor: float = config_field(1.0, minimum=1.0, help="YaRN context extension factor.")
    yarn_original_max_position_embeddings: int = config_field(
        4096, minimum=1, help="YaRN: context length the model was trained at."
    )
    yarn_beta_fast: float = config_field(32.0, help="YaRN: rotations above which dimensions extrapolate.")
    yarn_beta_slow: float = config_field(1.0, help="YaRN: rotations below which dimensions interpolate.")
    yarn_mscale: float = config_field(1.0, help="YaRN: numerator coefficient of the attention temperature.")
    yarn_mscale_all_dim: float = config_field(
        0.0, help="YaRN: denominator coefficient of the attention temperature (0 disables)."
    )
    yarn_correction_range_round_to_int: bool = config_field(
        True, help="YaRN: round the correction range outwards to whole dimensions."
    )
    # -- attention variants ------------------------------------------------------------------
    window_size: int | None = config_field(
        None,
        minimum=1,
        help="Sliding-window attention: a query sees at most this many most recent keys, itself included.",
    )
    window_attn_skip_freq: list[int] | None = config_field(  # noqa: RUF009 (returns a dataclass field)
        None,
        minimum=0,
        help="Which layers use the window: one value N makes every N-th layer full attention; "
        "num_layers values give a per-layer pattern (1 windowed, 0 full). Default: all windowed.",
    )
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = config_field(
        "vanilla",
        help="Attention softmax: vanilla, off-by-one (a sink logit fixed at 0) or learnable (a learned "
        "sink logit per head).",
    )
    cp_comm_type: Literal["p2p", "all_gather"] = config_field(
        "p2p",
        help="How context-parallel attention exchanges keys and values: p2p passes blocks around a ring "
        "(overlapped with compute), all_gather collects them all at once. Used when "
        "context_parallel_size > 1.",
    )
    softmax_scale: float | None = config_field(
        None, minimum=0.0, help="Scale of the attention scores. Default: 1 / sqrt(kv_channels)."
    )
    # -- embeddings, dropout, init -----------------------------------------------------------
    make_vocab_size_divisible_by: int = config_field(
        1,
        minimum=1,
        help="Pad the vocabulary to a multiple of this times the tensor-parallel size (Megatron uses "
        "128); padded ids are never predicted. Default 1: pad only when TP does not divide it.",
    )
    share_embeddings_and_output_weights: bool = config_field(
        False, help="Tie the output layer's weight to the input embedding."
    )
    attention_dropout: float = config_field(0.1, minimum=0.0, help="Dropout on attention probabilities.")
    hidden_dropout: float = config_field(
        0.1, minimum=0.0, help="Dropout on embeddings and on each residual branch."
    )
    init_method_std: float = config_field(0.02, minimum=0.0, help="Std of the normal weight initialisation.")
    use_scaled_init_for_output: bool = config_field(
        True, help="Scale the init std of residual-output layers by 1 / sqrt(2 * num_layers)."
    )
    # -- mixture of experts ------------------------------------------------------------------
    num_moe_experts: int | None = config_field(
        None, minimum=1, help="Experts per MoE layer; None builds dense MLPs."
    )
    moe_ffn_hidden_size: int | None = config_field(
        None, minimum=1, help="Hidden width of one routed expert. Default: ffn_hidden_size."
    )
    moe_router_topk: int = config_field(2, minimum=1, help="Experts each token is routed to.")
    moe_router_score_function: Literal["softmax", "sigmoid"] = config_field(
        "softmax", help="Router scores: softmax over experts, or an independent sigmoid per expert."
    )
    moe_router_pre_softmax: bool = config_field(
        False,
        help="Softmax: take the top-k of softmax(logits) (pre) instead of softmax over the top-k "
        "logits (post).",
    )
    moe_router_num_groups: int | None = config_field(
        None, minimum=1, help="Group-limited routing: experts form this many groups."
    )
    moe_router_group_topk: int | None = config_field(
        None, minimum=1, help="Group-limited routing: tokens pick experts only from this many best groups."
    )
    moe_router_linear_bias: bool = config_field(
        False,
        help="A learned per-expert bias on the router logits, x W^T + b (GPT-OSS): it moves both the "
        "top-k choice and the probabilities.",
    )
    moe_router_enable_expert_bias: bool = config_field(
        False,
        help="Aux-loss-free balancing: a per-expert bias added to the scores for the top-k choice only, "
        "moved by moe_router_bias_update_rate towards balance after each optimizer step.",
    )
    moe_router_bias_update_rate: float = config_field(
        1e-3, minimum=0.0, help="Step of the expert-bias update: bias += rate * sign(mean load - load)."
    )
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = (
        config_field(
            "aux_loss",
            help="Load-balancing loss over the micro-batch (aux_loss), per sequence (seq_aux_loss), with "
            "expert loads counted over the data-parallel ranks and the micro-batches of the step "
            "(global_aux_loss), or none.",
        )
    )
    moe_aux_loss_coeff: float = config_field(0.0, minimum=0.0, help="Weight of the load-balancing loss.")
    moe_z_loss_coeff: float | None = config_field(
        None, minimum=0.0, help="Weight of the router z-loss mean(logsumexp(logits)^2); None disables."
    )
    moe_input_jitter_eps: float | None = config_field(
        None,
        minimum=0.0,
        help="Training: multiply router inputs by noise uniform in [1 - eps, 1 + eps]; None disables.",
    )
    moe_expert_capacity_factor: float | None = config_field(
        None,
        minimum=0.0,
        help="Capacity per expert = ceil(tokens * topk / experts * factor); assignments beyond it are "
        "dropped. None: no capacity limit.",
    )
    moe_pad_expert_input_to_capacity: bool = config_field(
        False, help="Pad every expert's input to exactly its capacity (needs moe_expert_capacity_factor)."
    )
    moe_token_drop_policy: Literal["probs", "position"] = config_field(
        "probs",
        help="Over capacity, keep an expert's highest-probability assignments (probs) or its earliest "
        "tokens (position).",
    )
    moe_router_padding_for_alignment: int | None = config_field(
        None,
        minimum=1,
        help="Pad each expert's token count with zero rows up to a multiple of this (for quantized "
        "grouped GEMMs); None disables.",
    )
    moe_shared_expert_intermediate_size: int | None = config_field(
        None, minimum=1, help="Hidden width of the shared expert every token also goes through; None: none."
    )
    moe_shared_expert_gate: bool = config_field(
        False, help="Scale the shared expert's output by sigmoid(x . w) (Qwen2-MoE)."
    )
    moe_weighted_activation: bool = config_field(
        False,
        help="Multiply each routed row by its router probability inside the experts' activation, "
        "act(x) * p before fc2 (weighted SwiGLU, squared ReLU, quick-GeGLU, ...), instead of scaling "
        "the expert's output; the same unless fc2 has a bias.",
    )
    moe_grouped_gemm: bool = config_field(
        False, help="Run the local experts as one batched matmul instead of a loop of MLPs."
    )
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = config_field(
        "alltoall", help="How tokens reach experts on other expert-parallel ranks."
    )
    # -- activation recompute and implementation ---------------------------------------------
    recompute_granularity: Literal["full", "selective"] | None = config_field(
        None, help="Activation recompute: whole layers (full) or core attention only (selective)."
    )
    recompute_method: Literal["uniform", "block"] = config_field(
        "uniform",
        help="Full recompute: uniform checkpoints groups of recompute_num_layers layers; block "
        "checkpoints the first recompute_num_layers layers one by one.",
    )
    recompute_num_layers: int = config_field(
        1, minimum=1, help="Layers per group (uniform) or in total (block)."
    )
    transformer_impl: Literal["local", "transformer_engine"] = config_field(
        "local", help="Layer implementation: pure PyTorch, or Transformer Engine when it imports."
    )

    def __post_init__(self) -> None:
        if isinstance(self.window_attn_skip_freq, int):
            self.window_attn_skip_freq = [self.window_attn_skip_freq]
        super().__post_init__()
        self._check_parallelism_exists()
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    ["hidden_size", "num_attention_heads"],
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) unless kv_channels is set",
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                ["num_attention_heads", "num_query_groups"],
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_query_groups "
                f"({self.num_query_groups})",
            )
        tp = self.tensor_model_parallel_size
        if self.num_query_groups % tp:
            raise ConfigError(
                ["num_query_groups", "tensor_model_parallel_size"],
                f"num_query_groups ({self.num_query_groups}) must be divisible by the tensor-parallel size ({tp})",
            )
        self._check_window()
        self._check_rotary()
        self._check_moe()
        if self.activation_clamp_value is not None and self.activation not in GATED_ACTIVATIONS:
            raise ConfigError(
                ["activation_clamp_value", "activation"],
                f"clamping applies to gated activations {list(GATED_ACTIVATIONS)}, got {self.activation!r}",
            )

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates: ``int(kv_channels * rotary_percent)``."""
        return int(self.kv_channels * self.rotary_percent)

    def _check_rotary(self) -> None:
        if not 0 < self.rotary_percent <= 1:
            raise ConfigError(
                ["rotary_percent"], f"rotary_percent must be in (0, 1], got {self.rotary_percent}"
            )
        if self.position_embedding_type in ("rope", "yarn") and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ConfigError(
                ["rotary_percent", "kv_channels"],
                f"RoPE rotates int(kv_channels * rotary_percent) = {self.rotary_dim} channels; "
                "it must be even and at least 2",
            )

    def _check_parallelism_exists(self) -> None:
        """Expert-model and expert-tensor parallelism need MoE layers (``num_moe_experts``); the
        expert-tensor-parallel size must divide the experts' hidden width."""
        etp = self.expert_tensor_parallel_size
        if etp not in (None, 1) and self.num_moe_experts is None:
            raise ConfigError(
                ["expert_tensor_parallel_size", "num_moe_experts"],
                "expert tensor parallelism splits MoE experts; set num_moe_experts or keep the size at 1",
            )
        width = self.moe_ffn_hidden_size or self.ffn_hidden_size or 4 * self.hidden_size
        if etp is not None and width % etp:
            raise ConfigError(
                ["expert_tensor_parallel_size", "moe_ffn_hidden_size"],
                f"the experts' hidden width ({width}) must be divisible by expert_tensor_parallel_size ({etp})",
            )
        if self.expert_model_parallel_size != 1 and self.num_moe_experts is None:
            raise ConfigError(
                ["expert_model_parallel_size", "num_moe_experts"],
                "expert parallelism splits MoE experts; set num_moe_experts or keep the size at 1",
            )

    def _check_moe(self) -> None:
        experts = self.num_moe_experts
        if experts is None:
            moe_only = [f for f in ("moe_router_linear_bias", "moe_weighted_activation") if getattr(self, f)]
            if moe_only:
                raise ConfigError(
                    [*moe_only, "num_moe_experts"],
                    f"{', '.join(moe_only)} apply to MoE layers; set num_moe_experts or turn them off",
                )
            return
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.sequence_parallel:
            raise ConfigError(
                ["num_moe_experts", "sequence_parallel"],
                "MoE layers do not support sequence parallelism yet (with tensor parallelism, each TP "
                "rank runs the routed experts on all tokens)",
            )
        if self.transformer_impl != "local":
            raise ConfigError(
                ["num_moe_experts", "transformer_impl"],
                "MoE layers are built for transformer_impl 'local' only",
            )
        ep = self.expert_model_parallel_size
        if experts % ep:
            raise ConfigError(
                ["num_moe_experts", "expert_model_parallel_size"],
                f"num_moe_experts ({experts}) must be divisible by expert_model_parallel_size ({ep})",
            )
        topk = self.moe_router_topk
        if topk > experts:
            raise ConfigError(
                ["moe_router_topk", "num_moe_experts"],
                f"moe_router_topk ({topk}) must be at most num_moe_experts ({experts})",
            )
        if self.moe_router_pre_softmax and self.moe_router_score_function != "softmax":
            raise ConfigError(
                ["moe_router_pre_softmax", "moe_router_score_function"],
                "pre-softmax routing needs moe_router_score_function 'softmax'",
            )
        self._check_moe_groups(experts, topk)
        if self.moe_aux_loss_coeff > 0 and self.moe_router_load_balancing_type == "none":
            raise ConfigError(
                ["moe_aux_loss_coeff", "moe_router_load_balancing_type"],
                "a load-balancing loss coefficient needs a moe_router_load_balancing_type other than none",
            )
        if self.moe_input_jitter_eps is not None and not 0 < self.moe_input_jitter_eps < 1:
            raise ConfigError(["moe_input_jitter_eps"], f"must be in (0, 1), got {self.moe_input_jitter_eps}")
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor <= 0:
            raise ConfigError(["moe_expert_capacity_factor"], f"must be > 0, got {factor}")
        if factor is not None and self.context_parallel_size > 1:
            raise ConfigError(
                ["moe_expert_capacity_factor", "context_parallel_size"],
                "expert capacity with context parallelism is not supported: each CP rank would drop "
                "tokens by its own part of the sequences, not as the whole sequences do",
            )
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise ConfigError(
                ["moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"],
                "padding to capacity needs a capacity: set moe_expert_capacity_factor",
            )
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError(
                ["moe_shared_expert_gate", "moe_shared_expert_intermediate_size"],
                "a shared-expert gate needs a shared expert: set moe_shared_expert_intermediate_size",
            )

    def _check_moe_groups(self, experts: int, topk: int) -> None:
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups is None and group_topk is None:
            return
        names = ["moe_router_num_groups", "moe_router_group_topk"]
        if groups is None or group_topk is None:
            raise ConfigError(names, "group-limited routing needs both values")
        if experts % groups or group_topk > groups:
            raise ConfigError(
                [*names, "num_moe_experts"],
                f"num_moe_experts ({experts}) must divide into moe_router_num_groups ({groups}) groups, "
                f"of which moe_router_group_topk ({group_topk}) <= groups are kept",
            )
        if topk % group_topk or topk // group_topk > experts // groups:
            raise ConfigError(
                [*names, "moe_router_topk"],
                f"moe_router_topk ({topk}) must be a multiple of moe_router_group_topk ({group_topk}) and "
                f"take at most {experts // groups} experts per group",
            )

    def _check_window(self) -> None:
        pattern = self.window_attn_skip_freq
        if pattern is None:
            return
        if self.window_size is None:
            raise ConfigError(["window_attn_skip_freq", "window_size"], "a layer pattern needs window_size")
        if len(pattern) == 1:
            if pattern[0] < 1:
                raise ConfigError(["window_attn_skip_freq"], f"a frequency must be >= 1, got {pattern[0]}")
        elif len(pattern) != self.num_layers or any(v not in (0, 1) for v in pattern):
            raise ConfigError(
                ["window_attn_skip_freq", "num_layers"],
                f"a per-layer pattern needs num_layers ({self.num_layers}) values, each 0 or 1; got {pattern}",
            )

    def padded_vocab_size(self, vocab_size: int) -> int:
        """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by`` times
        ``tensor_model_parallel_size`` (the rows of the embedding and output layer)."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-vocab_size // multiple) * multiple

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLP's activation is gated (fc1 produces gate and up halves)."""
        return self.activation in GATED_ACTIVATIONS

    def is_window_attention_layer(self, layer_number: int) -> bool:
        """Whether 1-based ``layer_number`` uses sliding-window attention."""
        if self.window_size is None:
            return False
        pattern = self.window_attn_skip_freq
        if pattern is None:
            return True
        if len(pattern) == 1:
            return layer_number % pattern[0] != 0
        return bool(pattern[layer_number - 1])

    def window_for_layer(self, layer_number: int) -> int | None:
        """The window of 1-based ``layer_number``, or ``None`` for full attention."""
        return self.window_size if self.is_window_attention_layer(layer_number) else None
