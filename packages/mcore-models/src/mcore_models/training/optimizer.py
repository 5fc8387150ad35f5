"""The optimizers of ``mcore-train``: a local Adam/AdamW beside DDP, or mcore-parallel's ZeRO-1
``DistributedOptimizer``; both clip by the gradient norm of the whole model (all TP and PP ranks).

Both expose ``param_groups``, ``zero_grad()``, ``step() -> grad norm`` and, for checkpoints,
``param_states()`` / ``load_param_states(states, step)`` in one layout (per parameter: float32
``main`` value, ``exp_avg``, ``exp_avg_sq``), so a checkpoint of one loads into the other.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from mcore_parallel import DistributedDataParallel, DistributedOptimizer, OptimizerConfig, get_group_device

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _norm_weight(param: torch.nn.Parameter, tp_size: int) -> float:
    """Parameters replicated over TP ranks count once in the norm: each rank adds 1/tp of them."""
    return 1.0 if getattr(param, "tensor_model_parallel", False) else 1.0 / tp_size


def _all_reduce_sum(value: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
    return value


def _adam(params, config: OptimizerConfig) -> torch.optim.Optimizer:
    adam = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
    return adam(
        params,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )


class LocalOptimizer:
    """Adam/AdamW on a float32 copy of every parameter (the parameter itself when it is float32).

    ``step()`` waits for DDP's all-reduced ``main_grad``, clips by the norm over the model-parallel
    group ``mp_group`` (TP-replicated parameters counted once) and writes the result back.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        config: OptimizerConfig,
        tp_group: dist.ProcessGroup,
        mp_group: dist.ProcessGroup | None,
    ):
        self.model, self.config = model, config
        self.tp_size = dist.get_world_size(tp_group)
        self.mp_group = mp_group
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        self.main_params = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float()) for p in self.params
        ]
        self.optimizer = _adam(self.main_params, config)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()

    def step(self) -> float:
        self.model.finish_grad_sync()
        squares = torch.zeros((), dtype=torch.float64, device=get_group_device(self.mp_group))
        for param, main in zip(self.params, self.main_params, strict=True):
            main.grad = param.main_grad.float()
            squares += _norm_weight(param, self.tp_size) * main.grad.double().square().sum().to(squares.device)
        norm = math.sqrt(_all_reduce_sum(squares, [self.mp_group]).item())
        if self.config.clip_grad > 0 and norm > self.config.clip_grad:
            for main in self.main_params:
                main.grad.mul_(self.config.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        with torch.no_grad():
            for param, main in zip(self.params, self.main_params, strict=True):
                main.grad = None
                if main is not param:
                    param.copy_(main)
        return norm

    def _ensure_state(self) -> None:
        for main in self.main_params:
            state = self.optimizer.state[main]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in STATE_KEYS:
                    state[key] = torch.zeros_like(main)

    def param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Per model parameter: its float32 ``main`` value and Adam moments (views, not copies)."""
        self._ensure_state()
        return {
            param: {"main": main.detach(), **{k: self.optimizer.state[main][k] for k in STATE_KEYS}}
            for param, main in zip(self.params, self.main_params, strict=True)
        }

    def load_param_states(self, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: int) -> None:
        """Take full per-parameter states (``param_states``' layout) and the step count."""
        self._ensure_state()
        with torch.no_grad():
            for param, main in zip(self.params, self.main_params, strict=True):
                state = self.optimizer.state[main]
                state["step"].fill_(step)
                main.copy_(states[param]["main"])
                for key in STATE_KEYS:
                    state[key].copy_(states[param][key])
                if main is not param:
                    param.copy_(main)

    @property
    def step_count(self) -> int:
        steps = [int(state["step"]) for state in self.optimizer.state.values()]
        return steps[0] if steps else 0


class ModelParallelDistributedOptimizer(DistributedOptimizer):
    """mcore-parallel's ``DistributedOptimizer`` whose clipping norm also spans the TP and PP ranks
    (``mp_group``), TP-replicated parameters counted once, so every rank clips alike."""

    def __init__(
        self,
        model: DistributedDataParallel,
        config: OptimizerConfig,
        tp_group: dist.ProcessGroup,
        mp_group: dist.ProcessGroup | None,
    ):
        super().__init__(model, config)
        self.tp_size = dist.get_world_size(tp_group)
        self.mp_group = mp_group

    def _global_grad_norm(self) -> float:
        device = get_group_device(self.model.dp_group)
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for main, bucket in zip(self.main_params, self.buckets, strict=True):
            shard_end = bucket.shard_start + bucket.shard_numel
            for param, offset in bucket.param_offsets.items():
                start, end = max(offset, bucket.shard_start), min(offset + param.numel(), shard_end)
                if start < end:
                    grad = main.grad[start - bucket.shard_start : end - bucket.shard_start]
                    squares += _norm_weight(param, self.tp_size) * grad.double().square().sum().to(device)
        return math.sqrt(_all_reduce_sum(squares, [self.model.dp_group, self.mp_group]).item())

    def param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Per model parameter: float32 ``main`` and Adam moments, gathered over data-parallel ranks."""
        return self.gather_param_states()

    def load_param_states(self, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: int) -> None:
        """Take this rank's shards of full per-parameter states."""
        self.scatter_param_states(states, step)


def build_optimizer(
    model: DistributedDataParallel,
    config: OptimizerConfig,
    tp_group: dist.ProcessGroup,
    mp_group: dist.ProcessGroup | None,
) -> LocalOptimizer | ModelParallelDistributedOptimizer:
    """The distributed optimizer when ``model`` was wrapped for it, else the local one."""
    if model.config.use_distributed_optimizer:
        return ModelParallelDistributedOptimizer(model, config, tp_group, mp_group)
    return LocalOptimizer(model, config, tp_group, mp_group)
