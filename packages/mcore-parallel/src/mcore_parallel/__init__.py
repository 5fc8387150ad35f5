"""Parallelism for PyTorch training: process groups, tensor, sequence and pipeline parallelism, DDP
and the distributed optimizer, reshardable checkpoints, config dataclasses and the CLI generated
from them, and distributed-training utilities. Runs on CPU with gloo and on CUDA with NCCL.

The global getters of ``initialize_model_parallel`` live in ``mcore_parallel.parallel_state``.
"""

from importlib.metadata import version as _version

from mcore_parallel.checkpointing.checkpointer import (
    DistributedCheckpointer,
    checkpoint_dir,
    latest_iteration,
)
from mcore_parallel.checkpointing.sharded_state_dict import (
    load_sharded_optimizer_state_dict,
    sharded_model_state_dict,
    sharded_optimizer_state_dict,
    sharded_tensor,
)
from mcore_parallel.config.checkpoint import CheckpointConfig
from mcore_parallel.config.cli import add_dataclass_arguments, dataclass_from_args, flag_of, parse_dataclasses
from mcore_parallel.config.ddp import DistributedDataParallelConfig
from mcore_parallel.config.fields import ConfigError, config_field, validate_fields
from mcore_parallel.config.logger import LoggerConfig
from mcore_parallel.config.model_parallel import ModelParallelConfig
from mcore_parallel.config.optimizer import OptimizerConfig
from mcore_parallel.config.straggler import StragglerDetectionConfig
from mcore_parallel.device import get_backend, get_device, get_group_device, synchronize_device
from mcore_parallel.distributed.data_parallel import DistributedDataParallel
from mcore_parallel.distributed.grad_bucket import GradBucket
from mcore_parallel.distributed.grad_buffer import ParamAndGradBuffer
from mcore_parallel.optimizer.adam import build_adam_optimizer
from mcore_parallel.optimizer.distributed_optimizer import DistributedOptimizer
from mcore_parallel.optimizer.grad_norm import clip_grad_norm
from mcore_parallel.parallel_state import destroy_model_parallel, initialize_model_parallel
from mcore_parallel.pipeline_parallel.bridge import BridgeCommunicator
from mcore_parallel.pipeline_parallel.multi_module import MultiModuleProcessGroups
from mcore_parallel.pipeline_parallel.p2p import P2PCommunicator
from mcore_parallel.pipeline_parallel.schedule_plan import PipelineAction, schedule_actions
from mcore_parallel.pipeline_parallel.schedules import (
    ForwardStepFunc,
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    get_forward_backward_func,
)
from mcore_parallel.process_groups.collection import ProcessGroupCollection
from mcore_parallel.process_groups.hyper_comm_grid import HyperCommGrid
from mcore_parallel.process_groups.layout import DEFAULT_ORDER, make_parallel_grids
from mcore_parallel.tensor_parallel.checkpointing import checkpoint
from mcore_parallel.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from mcore_parallel.tensor_parallel.embedding import VocabParallelEmbedding, vocab_range
from mcore_parallel.tensor_parallel.initialization import default_init_method, sharded_parameter
from mcore_parallel.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from mcore_parallel.tensor_parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mcore_parallel.tensor_parallel.packed_weight import cpu_weight_packing_available, set_cpu_weight_packing
from mcore_parallel.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    get_device_rng_state,
    get_rng_tracker,
    model_parallel_manual_seed,
    set_device_rng_state,
)
from mcore_parallel.tensor_parallel.sequence_parallel_grads import reduce_sequence_parallel_grads
from mcore_parallel.utils.grad_compare import (
    GradientCheck,
    check_gradient,
    expected_error_bound,
    relative_difference,
    sharded_frobenius_norm,
)
from mcore_parallel.utils.nvtx import nvtx_range
from mcore_parallel.utils.ports import broadcast_free_port, ephemeral_port_range, find_free_port
from mcore_parallel.utils.straggler import StragglerDetector, StragglerReport
from mcore_parallel.utils.timers import Timer, Timers

__version__ = _version("mcore-parallel")

__all__ = [
    "DEFAULT_ORDER",
    "MODEL_PARALLEL_RNG",
    "BridgeCommunicator",
    "CheckpointConfig",
    "ColumnParallelLinear",
    "ConfigError",
    "DistributedCheckpointer",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "DistributedOptimizer",
    "ForwardStepFunc",
    "GradBucket",
    "GradientCheck",
    "HyperCommGrid",
    "LoggerConfig",
    "ModelParallelConfig",
    "MultiModuleProcessGroups",
    "OptimizerConfig",
    "P2PCommunicator",
    "ParamAndGradBuffer",
    "PipelineAction",
    "ProcessGroupCollection",
    "RNGStatesTracker",
    "RowParallelLinear",
    "StragglerDetectionConfig",
    "StragglerDetector",
    "StragglerReport",
    "Timer",
    "Timers",
    "VocabParallelEmbedding",
    "__version__",
    "add_dataclass_arguments",
    "all_to_all",
    "broadcast_free_port",
    "build_adam_optimizer",
    "check_gradient",
    "checkpoint",
    "checkpoint_dir",
    "clip_grad_norm",
    "config_field",
    "copy_to_tensor_model_parallel_region",
    "cpu_weight_packing_available",
    "dataclass_from_args",
    "default_init_method",
    "destroy_model_parallel",
    "ephemeral_port_range",
    "expected_error_bound",
    "find_free_port",
    "flag_of",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_backend",
    "get_device",
    "get_device_rng_state",
    "get_forward_backward_func",
    "get_group_device",
    "get_rng_tracker",
    "initialize_model_parallel",
    "latest_iteration",
    "load_sharded_optimizer_state_dict",
    "make_parallel_grids",
    "model_parallel_manual_seed",
    "nvtx_range",
    "parse_dataclasses",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_sequence_parallel_grads",
    "relative_difference",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "schedule_actions",
    "set_cpu_weight_packing",
    "set_device_rng_state",
    "sharded_frobenius_norm",
    "sharded_model_state_dict",
    "sharded_optimizer_state_dict",
    "sharded_parameter",
    "sharded_tensor",
    "synchronize_device",
    "validate_fields",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]
