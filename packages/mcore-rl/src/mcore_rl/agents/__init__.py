"""Agents and environments, decoupled from the RL algorithm: reward-only agents, rollout
generators over an inference handle (single, grouped for GRPO, contrastive pairs), weighted
multi-task mixing, evaluation (mean reward, pass@k) and the synthetic addition task."""

from mcore_rl.agents.addition import AdditionAgent, AdditionExample
from mcore_rl.agents.agent import RewardOnlyAgent, TaskExample
from mcore_rl.agents.evaluation import EvaluationResult, evaluate, pass_at_k
from mcore_rl.agents.generators import contrastive_pairs, grouped_rollouts, single_rollouts
from mcore_rl.agents.mixing import TaskMixture
from mcore_rl.agents.rollout import ContrastivePair, Rollout, RolloutGroup

__all__ = [
    "AdditionAgent",
    "AdditionExample",
    "ContrastivePair",
    "EvaluationResult",
    "RewardOnlyAgent",
    "Rollout",
    "RolloutGroup",
    "TaskExample",
    "TaskMixture",
    "contrastive_pairs",
    "evaluate",
    "grouped_rollouts",
    "pass_at_k",
    "single_rollouts",
]
