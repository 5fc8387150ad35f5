"""The configuration of ``mcore-train``: dataclasses whose field metadata generates the CLI.

``mcore-train`` parses ``TRAIN_CONFIG_CLASSES`` (these classes plus mcore-parallel's
``DistributedDataParallelConfig``, ``CheckpointConfig``, ``LoggerConfig`` and
``StragglerDetectionConfig``, then ``DistillationConfig``) into one ``TrainConfigs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from mcore_parallel import (
    CheckpointConfig,
    ConfigError,
    DistributedDataParallelConfig,
    LoggerConfig,
    OptimizerConfig,
    StragglerDetectionConfig,
    config_field,
    validate_fields,
)

from ..config.transformer_config import TransformerConfig
from ..models.hybrid.layer_pattern import HybridLayerPattern
from ..ssm.mamba_config import MambaConfig


@dataclass(kw_only=True)
class TrainModelConfig(MambaConfig, TransformerConfig):
    """Model: a TransformerConfig whose defaults are a small Llama-style model that trains in minutes on a CPU.

    With ``hybrid_layer_pattern`` the model is a ``HybridModel`` whose Mamba layers take the
    ``MambaConfig`` fields (``mamba``); without it, those fields must keep their defaults."""

    hybrid_layer_pattern: str | None = config_field(
        None,
        help="Train a hybrid model: one symbol per layer, M Mamba, * attention, - MLP, E MoE, with | "
        "between pipeline stages (e.g. 'M*-E|M*-E'); num_layers defaults to its length.",
    )

    num_layers: int = config_field(4, minimum=1, help="Number of transformer layers.")
    hidden_size: int = config_field(256, minimum=1, help="Width of the residual stream.")
    num_attention_heads: int = config_field(4, minimum=1, help="Query heads per attention layer.")
    ffn_hidden_size: int | None = config_field(
        688, minimum=1, help="Width of the MLP's hidden layer. Default: 4 * hidden_size."
    )
    normalization: Literal["LayerNorm", "RMSNorm"] = config_field("RMSNorm", help="Normalization layer type.")
    add_bias_linear: bool = config_field(False, help="Biases in all linear layers.")
    activation: Literal[
        "gelu", "gelu_tanh", "relu", "squared_relu", "silu", "swiglu", "geglu", "quick_geglu"
    ] = config_field(
        "swiglu", help="MLP activation; swiglu, geglu and quick_geglu are gated (fc1 twice as wide)."
    )
    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = config_field(
        "rope", help="How positions enter the model."
    )
    attention_dropout: float = config_field(0.0, minimum=0.0, help="Dropout on attention probabilities.")
    hidden_dropout: float = config_field(
        0.0, minimum=0.0, help="Dropout on embeddings and on each residual branch."
    )

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        MambaConfig.__post_init__(self)
        pattern = self.hybrid_layer_pattern
        pattern = None if pattern is None else HybridLayerPattern.parse(pattern)
        mamba_layers = pattern is not None and "M" in pattern.symbols
        changed = [f.name for f in dataclasses.fields(MambaConfig) if getattr(self, f.name) != f.default]
        if changed and not mamba_layers:
            raise ConfigError(
                [*changed, "hybrid_layer_pattern"],
                "Mamba options need Mamba layers ('M') in hybrid_layer_pattern",
            )
        if pattern is not None:
            self._check_hybrid(pattern, mamba_layers)

    def _check_hybrid(self, pattern: HybridLayerPattern, mamba_layers: bool) -> None:
        pattern.check_model(self)
        pattern.stage_layers(
            self.pipeline_model_parallel_size * (self.virtual_pipeline_model_parallel_size or 1)
        )
        if self.context_parallel_size > 1:
            raise ConfigError(
                ["context_parallel_size", "hybrid_layer_pattern"],
                "hybrid models do not support context parallelism yet",
            )
        tp = self.tensor_model_parallel_size
        if mamba_layers and (self.heads(self.hidden_size) % tp or self.mamba_num_groups % tp):
            raise ConfigError(
                ["mamba_num_heads", "mamba_num_groups", "tensor_model_parallel_size"],
                f"the Mamba heads ({self.heads(self.hidden_size)}) and groups ({self.mamba_num_groups}) must "
                f"be divisible by the tensor-parallel size ({tp})",
            )

    @property
    def mamba(self) -> MambaConfig:
        """The ``MambaConfig`` fields of this config, as a ``MambaConfig``."""
        return MambaConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MambaConfig)})


@dataclass
class TrainOptimizerConfig(OptimizerConfig):
    """Optimizer: Adam or AdamW (decoupled weight decay) on float32 main parameters, with gradient clipping."""

    lr: float = config_field(2e-3, minimum=0.0, help="Peak learning rate (after warm-up).")
    weight_decay: float = config_field(0.1, minimum=0.0, help="Weight-decay coefficient.")
    adam_beta2: float = config_field(0.95, minimum=0.0, help="Adam's second-moment decay.")
    clip_grad: float = config_field(
        1.0, minimum=0.0, help="Clip the global gradient norm to this value (0: no clipping)."
    )


@dataclass
class SchedulerConfig:
    """Learning-rate schedule: linear warm-up, then constant, linear, cosine or warmup-stable-decay (WSD)."""

    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = config_field(
        "cosine", help="How the learning rate falls from its peak to min_lr after warm-up."
    )
    lr_warmup_iters: int = config_field(16, minimum=0, help="Iterations of linear warm-up from 0 to lr.")
    lr_decay_iters: int | None = config_field(
        None, minimum=1, help="Iteration at which the decay reaches min_lr (default: train_iters)."
    )
    min_lr: float = config_field(1e-4, minimum=0.0, help="Learning rate at the end of the decay.")
    lr_wsd_decay_iters: int | None = config_field(
        None,
        minimum=1,
        help="WSD: iterations of the final decay; the rest after warm-up is stable (default: 20%% of decay).",
    )
    lr_wsd_decay_style: Literal["linear", "cosine"] = config_field(
        "linear", help="WSD: shape of the final decay."
    )

    def __post_init__(self) -> None:
        validate_fields(self)


@dataclass
class DataConfig:
    """Data: the embedded stdlib corpus (default) or your own indexed datasets, sequence length and masking."""

    seq_length: int = config_field(256, minimum=1, help="Tokens per training sample.")
    vocab_size: int = config_field(
        4096,
        minimum=16,
        help="Vocabulary of the default pipeline's BPE tokenizer (ignored with --tokenizer-file).",
    )
    data_path: str | None = config_field(
        None, help="Prefix of a training indexed dataset (PREFIX.bin/.idx from mcore-preprocess)."
    )
    heldout_data_path: str | None = config_field(
        None, help="Prefix of the held-out indexed dataset for evaluation (with --data-path)."
    )
    tokenizer_file: str | None = config_field(None, help="tokenizer.json of --data-path (required with it).")
    data_cache_dir: str | None = config_field(
        None, help="Cache of the default pipeline (default: $MCORE_CACHE_DIR or ~/.cache/mcore)."
    )
    eod_mask_loss: bool = config_field(
        False, help="Leave the token after each end-of-document out of the loss."
    )
    reset_position_ids: bool = config_field(False, help="Restart position ids after each end-of-document.")
    fim: bool = config_field(
        True,
        help="Fill-in-the-middle on the training samples of the default (code) corpus; held-out "
        "evaluation stays plain next-token. Your own --data-path data is never rearranged.",
    )
    fim_rate: float = config_field(
        0.5, minimum=0.0, help="FIM: probability that a training sample is rearranged."
    )
    fim_spm_rate: float = config_field(
        0.5, minimum=0.0, help="FIM: share of rearranged pieces written SPM instead of PSM."
    )
    fim_split_sample: int | None = config_field(
        None,
        minimum=0,
        help="FIM: token id (e.g. the end-of-document id 0) at which a sample is split into fragments, "
        "each rearranged on its own.",
    )
    fim_fragment_rate: float = config_field(
        0.5, minimum=0.0, help="FIM: probability that each fragment is rearranged."
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.data_path is not None and (self.tokenizer_file is None or self.heldout_data_path is None):
            raise ConfigError(
                ["data_path", "tokenizer_file", "heldout_data_path"],
                "your own data needs its tokenizer file and a held-out dataset",
            )
        for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
            if getattr(self, name) > 1.0:
                raise ConfigError([name], f"{name} is a probability in [0, 1], got {getattr(self, name)}")


@dataclass
class TrainingConfig:
    """Training: iterations, batch sizes, evaluation, output, launching and debugging switches."""

    train_iters: int = config_field(
        160, minimum=1, help="Optimizer steps to train for (in total, resumes included)."
    )
    micro_batch_size: int = config_field(
        4, minimum=1, help="Samples per micro-batch on one data-parallel rank."
    )
    global_batch_size: int | None = config_field(
        None,
        minimum=1,
        help="Samples per optimizer step over all data-parallel ranks; a multiple of micro_batch_size x DP "
        "gives gradient accumulation (default: micro_batch_size x DP).",
    )
    seed: int = config_field(1234, help="Seed of the weights, the data order and dropout.")
    eval_interval: int | None = config_field(
        40, minimum=1, help="Evaluate on held-out data every this many iterations (and always at the end)."
    )
    eval_iters: int = config_field(4, minimum=1, help="Global batches of held-out data per evaluation.")
    output_dir: str = config_field(
        "mcore-train-output", help="Where loss.png, report.json, sample.txt and checkpoints/ go."
    )
    nproc_per_node: int | None = config_field(
        None,
        minimum=1,
        help="Ranks to start when not under torchrun (default: every GPU, else 2 on a CPU).",
    )
    fp32: bool = config_field(False, help="Train in float32 on a GPU too (the default there is bfloat16).")
    fsdp: bool = config_field(
        False, help="Shard parameters, gradients and optimizer state with mcore-fsdp (mcore-models[fsdp])."
    )
    sample_tokens: int = config_field(
        64, minimum=0, help="Tokens to generate greedily from the trained model at the end (0: none)."
    )
    sample_prompt: str = config_field("def __init__(self", help="Prompt of the generated sample.")
    export_hf: str | None = config_field(
        None,
        help="Also write the final model as a Hugging Face checkpoint to this directory "
        "(Llama; with MoE layers Mixtral, Qwen3-MoE or Qwen2-MoE, at any expert-parallel size).",
    )
    save_grads_interval: int | None = config_field(
        None,
        minimum=1,
        help="Save data gradients (dgrad) and weight gradients (wgrad) of every linear layer every N iterations.",
    )
    progress: bool = config_field(True, help="Show a progress bar on rank 0.")
    fsdp_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = config_field(
        "optim_grads_params", help="With --fsdp: what is sharded over the data-parallel ranks."
    )
    moe_router_replay: Literal["off", "record", "replay"] = config_field(
        "off",
        help="MoE router replay: record the experts every training forward picks into "
        "--moe-router-replay-dir, or replay such a recording (same layout and batch shape) instead "
        "of routing.",
    )
    moe_router_replay_dir: str | None = config_field(
        None, help="Directory of the recorded routing (routing.json and one file per rank)."
    )
    sample_repetition_penalty: float = config_field(
        1.3,
        help="Repetition penalty of the greedy sample (Hugging Face's: scores of ids already in the "
        "sequence divided by it where positive, multiplied where negative; 1: plain greedy).",
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if not self.sample_repetition_penalty > 0:
            raise ConfigError(
                ["sample_repetition_penalty"], f"must be > 0, got {self.sample_repetition_penalty}"
            )
        if self.moe_router_replay != "off" and self.moe_router_replay_dir is None:
            raise ConfigError(
                ["moe_router_replay_dir", "moe_router_replay"],
                f"--moe-router-replay {self.moe_router_replay} needs the directory of the recording",
            )


@dataclass
class DistillationConfig:
    """Knowledge distillation: a frozen teacher from an mcore-train checkpoint, and the loss weights.

    The student's loss is ``kd_logit_weight x T² KL + kd_hidden_weight x (mean over the hidden
    pairs) + kd_ce_weight x cross entropy``. ``kd_ce_weight`` defaults to 0 (pure distillation, as
    Megatron-LM's ModelOpt distillation skips the LM loss by default).
    """

    teacher_load: str | None = config_field(
        None, help="KD: save directory of the teacher's mcore-train checkpoint (its latest iteration)."
    )
    teacher_config: str | None = config_field(
        None,
        help="KD: the teacher's model_config.json, for a checkpoint that does not describe itself "
        "(default: the checkpoint's own).",
    )
    kd_logit_weight: float = config_field(
        1.0, minimum=0.0, help="KD: weight of the KL divergence between student and teacher logits."
    )
    kd_ce_weight: float = config_field(
        0.0, minimum=0.0, help="KD: weight of the usual next-token cross entropy (0: pure distillation)."
    )
    kd_temperature: float = config_field(
        1.0,
        minimum=0.0,
        help="KD: softmax temperature T (> 0) of both distributions; the KL is scaled by T².",
    )
    kd_direction: Literal["forward", "reverse"] = config_field(
        "forward", help="KD: KL(teacher || student) (forward) or KL(student || teacher) (reverse)."
    )
    kd_hidden_pairs: str = config_field(
        "",
        help="KD: student:teacher layer pairs (0-based) whose outputs are compared, e.g. '0:1,3:7' (empty: none).",
    )
    kd_hidden_kind: Literal["cosine", "mse"] = config_field(
        "cosine", help="KD: distance between paired hidden states (1 - cosine similarity, or MSE)."
    )
    kd_hidden_weight: float = config_field(
        1.0, minimum=0.0, help="KD: weight of the mean hidden-state loss over the pairs."
    )
    kd_hidden_projection: bool = config_field(
        False,
        help="KD: a learned linear map per pair from the student's width to the teacher's (needed "
        "when they differ; trained with the student and saved in its checkpoints).",
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        if self.kd_temperature <= 0:
            raise ConfigError(["kd_temperature"], f"the temperature must be > 0, got {self.kd_temperature}")
        pairs = self.hidden_pairs  # parses, or raises
        changed = [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "teacher_load" and getattr(self, f.name) != f.default
        ]
        if self.teacher_load is None and changed:
            raise ConfigError(
                ["teacher_load", *changed], "distillation options need a teacher (--teacher-load)"
            )
        hidden_options = [
            name for name in changed if name.startswith("kd_hidden_") and name != "kd_hidden_pairs"
        ]
        if not pairs and hidden_options:
            raise ConfigError(
                ["kd_hidden_pairs", *hidden_options],
                "hidden-state options need layer pairs (--kd-hidden-pairs)",
            )
        hidden = self.kd_hidden_weight if pairs else 0.0
        if self.teacher_load is not None and self.kd_logit_weight + self.kd_ce_weight + hidden == 0:
            raise ConfigError(
                ["kd_logit_weight", "kd_ce_weight", "kd_hidden_weight"], "the loss weights are all zero"
            )

    @property
    def hidden_pairs(self) -> list[tuple[int, int]]:
        """``kd_hidden_pairs`` as ``[(student layer, teacher layer), ...]``.

        Raises:
            ConfigError: not comma-separated ``S:T`` pairs of non-negative integers.
        """
        pairs = []
        for item in filter(None, (part.strip() for part in self.kd_hidden_pairs.split(","))):
            student, colon, teacher = item.partition(":")
            if not (colon and student.strip().isdigit() and teacher.strip().isdigit()):
                raise ConfigError(
                    ["kd_hidden_pairs"],
                    f"{item!r} is not a pair STUDENT:TEACHER of 0-based layer indices (e.g. '0:1,3:7')",
                )
            pairs.append((int(student), int(teacher)))
        return pairs


TRAIN_CONFIG_CLASSES: tuple[type, ...] = (
    TrainModelConfig,
    TrainOptimizerConfig,
    SchedulerConfig,
    DataConfig,
    TrainingConfig,
    DistributedDataParallelConfig,
    CheckpointConfig,
    LoggerConfig,
    StragglerDetectionConfig,
    DistillationConfig,
)
"""The config classes ``mcore-train`` parses, in the order of ``TrainConfigs``' fields."""


@dataclass
class TrainConfigs:
    """Every config of one ``mcore-train`` run."""

    model: TrainModelConfig = dataclasses.field(default_factory=TrainModelConfig)
    optimizer: TrainOptimizerConfig = dataclasses.field(default_factory=TrainOptimizerConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    ddp: DistributedDataParallelConfig = dataclasses.field(default_factory=DistributedDataParallelConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logger: LoggerConfig = dataclasses.field(default_factory=LoggerConfig)
    straggler: StragglerDetectionConfig = dataclasses.field(default_factory=StragglerDetectionConfig)
    distillation: DistillationConfig = dataclasses.field(default_factory=DistillationConfig)

    @classmethod
    def from_instances(cls, instances) -> TrainConfigs:
        """Build from one instance of each of ``TRAIN_CONFIG_CLASSES``, in that order."""
        return cls(*instances)
