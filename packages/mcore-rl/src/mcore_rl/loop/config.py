"""The configuration of the RL loop and of ``mcore-rl``: dataclasses whose field metadata
generates the command line (mcore-parallel's ``config_field``), as ``mcore-train``'s do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_api import experimental_api
from mcore_models import TransformerConfig
from mcore_parallel import ConfigError, OptimizerConfig, config_field

from ..loss_config import GRPOLossConfig
from .fsdp import FSDP_STRATEGIES, require_fsdp


@experimental_api
@dataclass
class AdditionTaskConfig:
    """Task: the synthetic addition task of the embedded default (``AdditionAgent``)."""

    min_digits: int = config_field(1, minimum=1, help="Fewest digits of an operand.")
    max_digits: int = config_field(2, minimum=1, help="Most digits of an operand.")
    num_train: int = config_field(2000, minimum=1, help="Sums in the training split (the RL prompts).")
    num_warmup: int = config_field(
        2000,
        minimum=0,
        help="Sums of the supervised warm-up, none among the RL prompts or the held-out sums "
        "(0: the warm-up trains on the RL prompts' sums).",
    )
    num_test: int = config_field(
        200, minimum=1, help="Held-out sums (evaluation), none shared with training."
    )
    task_seed: int = config_field(0, minimum=0, help="Seed of the task's splits.")
    partial_credit: bool = config_field(
        True, help="Reward a wrong answer with half the share of its right digits (below 0.5)."
    )

    def __post_init__(self) -> None:
        if self.max_digits < self.min_digits or self.max_digits > 18:
            raise ConfigError(
                ["min_digits", "max_digits"],
                f"need min_digits <= max_digits <= 18, got {self.min_digits} and {self.max_digits}",
            )


@experimental_api
@dataclass
class PolicyConfig:
    """Policy: a small Llama-style GPTModel (RMSNorm, SwiGLU, RoPE), trained in float32."""

    num_layers: int = config_field(2, minimum=1, help="Transformer layers.")
    hidden_size: int = config_field(128, minimum=1, help="Width of the residual stream.")
    num_attention_heads: int = config_field(4, minimum=1, help="Attention heads.")
    ffn_hidden_size: int = config_field(384, minimum=1, help="Width of the MLP's hidden layer.")
    model_seed: int = config_field(1234, minimum=0, help="Seed of the initial weights.")

    def transformer_config(self) -> TransformerConfig:
        """The model's ``TransformerConfig``."""
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm",
            activation="swiglu",
            position_embedding_type="rope",
            add_bias_linear=False,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )


@experimental_api
@dataclass
class WarmupConfig:
    """Supervised warm-up before RL: demonstrations of the task (a share of them flawed), so the
    policy starts partly right."""

    sft_steps: int = config_field(1600, minimum=0, help="Supervised steps (0: none).")
    sft_batch_size: int = config_field(32, minimum=1, help="Sums per supervised step.")
    sft_lr: float = config_field(1e-3, minimum=0.0, help="Learning rate of the supervised run (AdamW).")
    demo_error_rate: float = config_field(
        0.3,
        minimum=0.0,
        help="Share of the warm-up's demonstrations whose answer has a wrong last digit (one more, "
        "mod 10), drawn anew each time a sum is shown: imperfect demonstrations, which the "
        "policy learns to copy and GRPO's verified reward teaches it to avoid (0: all right).",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.demo_error_rate <= 1.0:
            raise ConfigError(["demo_error_rate"], f"must be in [0, 1], got {self.demo_error_rate}")


@experimental_api
@dataclass
class GRPOLoopConfig:
    """GRPO: rollouts through the inference engine, group-normalised advantages, clipped policy loss."""

    iterations: int = config_field(
        100, minimum=1, help="RL iterations (rollouts, then `minibatches` optimizer steps)."
    )
    prompts_per_iteration: int = config_field(64, minimum=1, help="Training prompts per iteration.")
    group_size: int = config_field(8, minimum=2, help="Completions sampled per prompt.")
    max_tokens: int = config_field(8, minimum=1, help="Most tokens per completion.")
    temperature: float = config_field(1.0, minimum=0.01, help="Sampling temperature of the rollouts.")
    minibatches: int = config_field(
        1,
        minimum=1,
        help="Optimizer steps per iteration, each on a consecutive share of the prompt groups "
        "(the later ones off-policy: the clipped ratio against the rollouts' log-probs).",
    )
    lr: float = config_field(1e-4, minimum=0.0, help="Learning rate of the policy (Adam).")
    lr_warmup_iterations: int = config_field(
        10, minimum=0, help="Iterations over which the learning rate rises linearly to lr."
    )
    clip_grad: float = config_field(1.0, minimum=0.0, help="Clip the gradient norm to this (0: off).")
    distributed_optimizer: bool = config_field(
        False,
        help="Shard the optimizer state over the data-parallel ranks (mcore-parallel's DistributedOptimizer).",
    )
    optimizer_cpu_offload: bool = config_field(
        False, help="Keep the optimizer's float32 main weights and Adam state on the CPU."
    )
    beta: float = config_field(
        0.0, minimum=0.0, help="KL coefficient to the frozen reference policy (0: no reference is built)."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = config_field("k3", help="KL estimator.")
    clip_low: float = config_field(0.2, minimum=0.0, help="Lower clip of the importance ratio.")
    clip_high: float = config_field(0.28, minimum=0.0, help="Upper clip of the importance ratio.")
    aggregation: Literal["token_mean", "sequence_mean"] = config_field(
        "token_mean", help="How the loss averages over tokens."
    )
    scale_rewards: Literal["group", "none"] = config_field(
        "none", help="Divide advantages by the group's reward std ('group') or not ('none': Dr. GRPO)."
    )
    bin_length: int = config_field(
        128,
        minimum=2,
        help="Most tokens per packed training row. Each optimizer step packs its rollouts into rows of "
        "the length, up to this, that pads them least (one sequence per row when they are alike; "
        "packed attention costs the square of the row's length).",
    )
    bins_per_forward: int = config_field(
        32,
        minimum=1,
        help="Tokens per forward and backward, in bins of bin_length: the packed rows are stacked "
        "up to bins_per_forward x bin_length tokens a pass (more: fewer, larger passes, more "
        "activation memory).",
    )
    max_sequence_length: int = config_field(
        128,
        minimum=2,
        help="Most tokens of a prompt and its completion: the inference engine's context (at most bin_length).",
    )
    eval_interval: int = config_field(
        10, minimum=0, help="Evaluate on held-out prompts every this many iterations (0: only at the end)."
    )
    eval_prompts: int | None = config_field(
        None, minimum=1, help="Held-out prompts per evaluation (default: the whole test split)."
    )
    eval_samples: int = config_field(
        4, minimum=1, help="Sampled completions per held-out prompt for the held-out reward."
    )
    seed: int = config_field(0, minimum=0, help="Seed of the prompt order and of the rollouts' sampling.")
    fsdp: bool = config_field(
        False,
        help="Train the policy fully sharded over the data-parallel ranks with mcore-fsdp (each "
        "transformer layer a unit; needs pip install 'mcore-rl[fsdp]') instead of DDP.",
    )
    fsdp_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = config_field(
        "optim_grads_params", help="With --fsdp: what is sharded over the data-parallel ranks."
    )

    def __post_init__(self) -> None:
        if self.fsdp_strategy not in FSDP_STRATEGIES:
            raise ConfigError(
                ["fsdp_strategy"], f"must be one of {list(FSDP_STRATEGIES)}, got {self.fsdp_strategy!r}"
            )
        if self.fsdp and self.distributed_optimizer:
            raise ConfigError(
                ["fsdp", "distributed_optimizer"],
                "fsdp shards the optimizer state itself: turn off distributed_optimizer",
            )
        if self.fsdp:
            require_fsdp()  # refuse a missing mcore-fsdp before anything is built
        if self.max_sequence_length > self.bin_length:
            raise ConfigError(
                ["max_sequence_length", "bin_length"],
                f"a sequence must fit in a bin: need max_sequence_length <= bin_length, got "
                f"{self.max_sequence_length} and {self.bin_length}",
            )

    def loss_config(self) -> GRPOLossConfig:
        """The ``GRPOLossConfig`` of these settings."""
        return GRPOLossConfig(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            beta=self.beta,
            kl_estimator=self.kl_estimator,
            aggregation=self.aggregation,
            scale_rewards=self.scale_rewards,
        )

    def optimizer_config(self) -> OptimizerConfig:
        """The policy optimizer's ``OptimizerConfig`` (Adam, no weight decay)."""
        return OptimizerConfig(
            lr=self.lr,
            weight_decay=0.0,
            clip_grad=self.clip_grad,
            optimizer_cpu_offload=self.optimizer_cpu_offload,
        )


@experimental_api
@dataclass
class RunConfig:
    """Run: where the outputs go, checkpoints, progress."""

    output_dir: str = config_field(
        "mcore-rl-output", help="Where reward.png, report.json and checkpoint/ go."
    )
    save_interval: int = config_field(
        0, minimum=0, help="Save a checkpoint every this many iterations (0: only at the end)."
    )
    load: str | None = config_field(
        None,
        help="Resume from this checkpoint directory (its RL state: policy, optimizer, reference, data, RNG).",
    )
    progress: bool = config_field(True, help="Show a progress bar.")


CONFIG_CLASSES = (AdditionTaskConfig, PolicyConfig, WarmupConfig, GRPOLoopConfig, RunConfig)
"""The classes ``mcore-rl`` parses its options into, in order."""


@experimental_api
@dataclass
class RLConfigs:
    """All the settings of an ``mcore-rl`` run, one instance of each config class."""

    task: AdditionTaskConfig = field(default_factory=AdditionTaskConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    grpo: GRPOLoopConfig = field(default_factory=GRPOLoopConfig)
    run: RunConfig = field(default_factory=RunConfig)
