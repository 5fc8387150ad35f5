"""GRPO-family losses and advantages for reinforcement-learning post-training, in plain PyTorch:
group-normalised advantages, the clipped policy loss with KL penalty, entropy bonus and truncated
importance sampling. The rest of the RL stack (agents, inference interfaces, packing, the loop)
is planned."""

from importlib.metadata import version as _version

from mcore_rl.advantages import GroupAdvantages, group_advantages
from mcore_rl.kl import kl_estimate
from mcore_rl.loss_config import GRPOLossConfig
from mcore_rl.policy_loss import GRPOLoss, grpo_loss

__version__ = _version("mcore-rl")

__all__ = [
    "GRPOLoss",
    "GRPOLossConfig",
    "GroupAdvantages",
    "__version__",
    "group_advantages",
    "grpo_loss",
    "kl_estimate",
]
