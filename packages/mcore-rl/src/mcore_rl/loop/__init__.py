"""The RL loop: GRPO on an mcore policy with rollouts from a live in-process inference engine
(refit after every step, KV cache suspended while training), checkpoint and resume of the whole
RL state, and the embedded default run of ``mcore-rl`` (addition, character tokenizer,
supervised warm-up, ``reward.png`` and ``report.json``)."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import (
    AdditionTaskConfig,
    GRPOLoopConfig,
    PolicyConfig,
    RLConfigs,
    RunConfig,
    WarmupConfig,
)
from .default_run import run_default
from .grpo_loop import GRPOLoop
from .tokenizer import CharTokenizer
from .warmup import supervised_warmup

__all__ = [
    "AdditionTaskConfig",
    "CharTokenizer",
    "CheckpointError",
    "GRPOLoop",
    "GRPOLoopConfig",
    "PolicyConfig",
    "RLConfigs",
    "RunConfig",
    "WarmupConfig",
    "load_checkpoint",
    "run_default",
    "save_checkpoint",
    "supervised_warmup",
]
