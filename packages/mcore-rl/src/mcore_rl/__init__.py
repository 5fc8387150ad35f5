"""GRPO-family reinforcement-learning post-training on mcore: losses and advantages, agents and
environments, inference handles (the mcore engine, OpenAI-compatible HTTP, Hugging Face), sequence
packing and weight refit into a live engine."""

from importlib.metadata import version as _version

from mcore_rl.advantages import GroupAdvantages, group_advantages
from mcore_rl.agents import (
    AdditionAgent,
    AdditionExample,
    ContrastivePair,
    EvaluationResult,
    RewardOnlyAgent,
    Rollout,
    RolloutGroup,
    TaskExample,
    TaskMixture,
    contrastive_pairs,
    evaluate,
    grouped_rollouts,
    pass_at_k,
    single_rollouts,
)
from mcore_rl.inference import (
    EndpointUnavailableError,
    EngineHandle,
    Generation,
    GenerationError,
    HFHandle,
    InferenceHandle,
    OpenAIHandle,
    SamplingOptions,
    VocabularyMismatchError,
    check_vocabulary,
)
from mcore_rl.kl import kl_estimate
from mcore_rl.loss_config import GRPOLossConfig
from mcore_rl.packing import (
    PackedBatch,
    PackedBin,
    TrainingSequence,
    label_logprobs,
    pack_sequences,
    packed_grpo_loss,
    unpack_completions,
)
from mcore_rl.policy_loss import GRPOLoss, grpo_loss
from mcore_rl.refit import EngineBusyError, RefitError, RefitMismatchError, refit

__version__ = _version("mcore-rl")

__all__ = [
    "AdditionAgent",
    "AdditionExample",
    "ContrastivePair",
    "EndpointUnavailableError",
    "EngineBusyError",
    "EngineHandle",
    "EvaluationResult",
    "GRPOLoss",
    "GRPOLossConfig",
    "Generation",
    "GenerationError",
    "GroupAdvantages",
    "HFHandle",
    "InferenceHandle",
    "OpenAIHandle",
    "PackedBatch",
    "PackedBin",
    "RefitError",
    "RefitMismatchError",
    "RewardOnlyAgent",
    "Rollout",
    "RolloutGroup",
    "SamplingOptions",
    "TaskExample",
    "TaskMixture",
    "TrainingSequence",
    "VocabularyMismatchError",
    "__version__",
    "check_vocabulary",
    "contrastive_pairs",
    "evaluate",
    "group_advantages",
    "grouped_rollouts",
    "grpo_loss",
    "kl_estimate",
    "label_logprobs",
    "pack_sequences",
    "packed_grpo_loss",
    "pass_at_k",
    "refit",
    "single_rollouts",
    "unpack_completions",
]
