"""The optimizers of ``mcore-train``: mcore-parallel's ZeRO-1 ``DistributedOptimizer``, or
``LocalOptimizer``, plain Adam/AdamW beside DDP's all-reduced gradients.

Both clip by the gradient norm of the whole model (all TP, PP and DP ranks, mcore-parallel's
``clip_grad_norm`` rules) and share the checkpoint interface ``gather_param_states()`` /
``scatter_param_states(states, step)`` / ``step_count`` (per parameter: float32 ``main`` value,
``exp_avg``, ``exp_avg_sq``), so a checkpoint of one loads into the other.
"""

from __future__ import annotations

import torch
from mcore_api import experimental_api
from mcore_parallel import (
    DistributedDataParallel,
    DistributedOptimizer,
    OptimizerConfig,
    ProcessGroupCollection,
    build_adam_optimizer,
    clip_grad_norm,
)

STATE_KEYS = ("exp_avg", "exp_avg_sq")


@experimental_api
class LocalOptimizer:
    """Adam/AdamW on a float32 copy of every parameter (the parameter itself when it is float32).

    ``step()`` waits for DDP's all-reduced ``main_grad``, clips it by the global norm and writes
    the updated values back into the model's parameters. Returns the norm before clipping.
    With ``optimizer_cpu_offload`` the first parameters, up to ``optimizer_offload_fraction`` of
    all elements, keep their float32 main copy and Adam state on the CPU (``offloaded_numel``
    counts them) and are updated there.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        config: OptimizerConfig,
        process_groups: ProcessGroupCollection | None = None,
    ):
        self.model, self.config, self.process_groups = model, config, process_groups
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        offload_budget = total * config.optimizer_offload_fraction if config.optimizer_cpu_offload else 0
        self.offloaded_numel = 0
        self.main_params = []
        for param in self.params:
            device = param.device
            if self.offloaded_numel + param.numel() <= offload_budget:
                device = torch.device("cpu")
                self.offloaded_numel += param.numel()
            if param.dtype == torch.float32 and param.device == device:
                self.main_params.append(param)
            else:
                main = param.detach().to(device=device, dtype=torch.float32, copy=True)
                self.main_params.append(torch.nn.Parameter(main))
        self.optimizer = build_adam_optimizer(self.main_params, config)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (set ``lr`` here for schedules)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Zero the model's gradient buffers."""
        self.model.zero_grad_buffer()

    def step(self) -> float:
        self.model.finish_grad_sync()
        norm = clip_grad_norm(self.params, self.config.clip_grad, self.process_groups)
        for param, main in zip(self.params, self.main_params, strict=True):
            main.grad = param.main_grad.to(device=main.device, dtype=torch.float32)
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

    def gather_param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Per model parameter: its float32 ``main`` value and Adam moments (views, not copies)."""
        self._ensure_state()
        return {
            param: {"main": main.detach(), **{k: self.optimizer.state[main][k] for k in STATE_KEYS}}
            for param, main in zip(self.params, self.main_params, strict=True)
        }

    def scatter_param_states(
        self, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: int
    ) -> None:
        """Take full per-parameter states (``gather_param_states``' layout) and the step count."""
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
        """Optimizer steps taken so far."""
        steps = [int(state["step"]) for state in self.optimizer.state.values()]
        return steps[0] if steps else 0


@experimental_api
def build_optimizer(
    model: DistributedDataParallel, config: OptimizerConfig, process_groups: ProcessGroupCollection
) -> LocalOptimizer | DistributedOptimizer:
    """The distributed optimizer when ``model`` was wrapped for it, else the local one."""
    if model.config.use_distributed_optimizer:
        return DistributedOptimizer(model, config, process_groups)
    return LocalOptimizer(model, config, process_groups)
