"""The training loop and ``mcore-train``: configs (the CLI is generated from them), launching,
pretraining with TP/PP/VPP/DP/SP and the distributed optimizer, checkpoints that load at any
layout, held-out evaluation, greedy samples, knowledge distillation from a frozen teacher and the run's report.
"""

from mcore_models.training.batches import (
    TrainData,
    iteration_micro_batches,
    open_indexed_data,
    open_train_data,
)
from mcore_models.training.checkpointing import (
    load_training_checkpoint,
    save_training_checkpoint,
    training_state_dict,
)
from mcore_models.training.cli import main, parse_train_args
from mcore_models.training.config import (
    TRAIN_CONFIG_CLASSES,
    DataConfig,
    DistillationConfig,
    SchedulerConfig,
    TrainConfigs,
    TrainingConfig,
    TrainModelConfig,
    TrainOptimizerConfig,
)
from mcore_models.training.distillation_losses import hidden_state_loss, logit_kl_loss
from mcore_models.training.evaluation import evaluate
from mcore_models.training.generation import greedy_generate
from mcore_models.training.launcher import launch_local, run_in_process_group, under_torchrun
from mcore_models.training.loop import pretrain, resolve_configs
from mcore_models.training.lr_schedule import learning_rate
from mcore_models.training.model_setup import TrainModel, build_train_model
from mcore_models.training.optimizer import LocalOptimizer, build_optimizer
from mcore_models.training.optimizer_protocol import TrainOptimizer
from mcore_models.training.stateful import Stateful
from mcore_models.training.trainer import Trainer

__all__ = [
    "TRAIN_CONFIG_CLASSES",
    "DataConfig",
    "DistillationConfig",
    "LocalOptimizer",
    "SchedulerConfig",
    "Stateful",
    "TrainConfigs",
    "TrainData",
    "TrainModel",
    "TrainModelConfig",
    "TrainOptimizer",
    "TrainOptimizerConfig",
    "Trainer",
    "TrainingConfig",
    "build_optimizer",
    "build_train_model",
    "evaluate",
    "greedy_generate",
    "hidden_state_loss",
    "iteration_micro_batches",
    "launch_local",
    "learning_rate",
    "load_training_checkpoint",
    "logit_kl_loss",
    "main",
    "open_indexed_data",
    "open_train_data",
    "parse_train_args",
    "pretrain",
    "resolve_configs",
    "run_in_process_group",
    "save_training_checkpoint",
    "training_state_dict",
    "under_torchrun",
]
