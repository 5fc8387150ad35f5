"""The mcore-fsdp backend of ``GRPOLoop`` (``GRPOLoopConfig.fsdp``): the policy sharded in place
with ``mcore_fsdp.fully_shard`` over the data-parallel group, each ``TransformerLayer`` a sharding
unit (embedding, final norm and output layer form the root unit), and Adam on its FP32
main-parameter shards, clipped by the sharded model's ``clip_grad_norm_``.

``mcore_fsdp`` (the optional ``fsdp`` extra) is imported only here, only when ``fsdp`` is on.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from mcore_models import GPTModel, TransformerLayer
from mcore_parallel import ConfigError, OptimizerConfig, build_adam_optimizer, get_group_device

FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""mcore-fsdp's sharding strategies, least to most sharded (as ``mcore-train --fsdp-strategy``)."""

STATE_KEYS = ("exp_avg", "exp_avg_sq")
"""Adam's per-parameter moments, as the DDP optimizers' ``gather_param_states`` name them."""


def require_fsdp() -> None:
    """Import ``mcore_fsdp``, or refuse ``fsdp`` without it.

    Raises:
        ConfigError: naming ``fsdp`` and the extra that installs mcore-fsdp.
    """
    try:
        import mcore_fsdp  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            ["fsdp"], "fsdp needs the mcore-fsdp package: pip install 'mcore-rl[fsdp]'"
        ) from error


def check_fsdp_policy(policy: GPTModel) -> None:
    """Refuse, before anything is built, a policy the FSDP backend cannot train.

    Raises:
        ConfigError: mcore-fsdp is not installed (``fsdp``), or the policy is split over
            tensor-parallel ranks (``fsdp``, ``tensor_model_parallel_size``).
    """
    require_fsdp()
    group = policy.tp_group
    if group is not None and dist.get_world_size(group) > 1:
        raise ConfigError(
            ["fsdp", "tensor_model_parallel_size"],
            "the loop's FSDP backend shards a policy that is whole on each rank: got "
            f"tensor_model_parallel_size={dist.get_world_size(group)}; use 1, or DDP (fsdp off) "
            "with tensor parallelism",
        )


def shard_policy(
    policy: GPTModel, group: dist.ProcessGroup, strategy: str, offload_optimizer: bool
) -> GPTModel:
    """``policy``, sharded in place over ``group`` (each ``TransformerLayer`` a unit) with
    ``strategy``; with ``offload_optimizer`` its FP32 main parameters and gradients, and so the
    optimizer state, live on the CPU. Returns the same module (now also an ``FSDPModule``)."""
    require_fsdp()
    from mcore_fsdp import fully_shard

    return fully_shard(
        policy,
        mesh=group,
        unit_classes=(TransformerLayer,),
        strategy=strategy,
        offload_optimizer=offload_optimizer,
    )


class FSDPAdam:
    """Adam on a sharded model's FP32 main-parameter shards, with the interface the loop and its
    checkpoint use of mcore-models' ``LocalOptimizer``: ``param_groups``, ``zero_grad()``,
    ``step()`` (clip by the global norm, ``clip_grad`` 0: norm only; returns the norm before
    clipping), ``step_count`` and the whole per-parameter states ``gather_param_states()`` /
    ``scatter_param_states()`` (float32 ``main`` value, ``exp_avg``, ``exp_avg_sq`` in the
    parameter's full shape), so a checkpoint of one backend loads into the other."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig, group: dist.ProcessGroup):
        self.model, self.config, self.group = model, config, group
        self.optimizer = build_adam_optimizer(model.parameters(), config)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (set ``lr`` here for schedules)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Free the main gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        """Clip the main gradients by their global norm, then step; returns the norm before clipping."""
        norm = self.model.clip_grad_norm_(self.config.clip_grad or math.inf)
        self.optimizer.step()
        return float(norm)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        steps = [int(state["step"]) for state in self.optimizer.state.values() if "step" in state]
        return steps[0] if steps else 0

    def _ensure_state(self) -> None:
        """Adam's state before its first step (step 0, zero moments), where there is none yet:
        ``optimizer_state_dict`` would otherwise create it with a step that counts."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for key in STATE_KEYS:
                        state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def gather_param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Per main parameter (as ``model.named_parameters()`` holds it): its whole float32
        ``main`` value and Adam moments in the parameter's full shape. Collective over the
        model's data-parallel group."""
        from mcore_fsdp import optimizer_state_dict
        from torch.distributed.tensor import DTensor

        self._ensure_state()
        saved = optimizer_state_dict(self.model, self.optimizer)["state"]
        mains = self.model.full_state_dict(cpu=False)
        states = {}
        for name, param in self.model.named_parameters():
            main = mains[name]
            entry = {"main": main}
            for key in STATE_KEYS:
                value = saved[name][key]
                value = value.full_tensor() if isinstance(value, DTensor) else value
                entry[key] = value.reshape(main.shape)
            states[param] = entry
        return states

    def scatter_param_states(
        self, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: int
    ) -> None:
        """Take whole per-parameter states (``gather_param_states``' layout, keyed by the main
        parameters) and the step count: each rank keeps its shards."""
        from mcore_fsdp import load_optimizer_state_dict
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate

        self._ensure_state()
        named = dict(self.model.named_parameters())
        self.model.load_state_dict(
            {name: states[param]["main"] for name, param in named.items()}, strict=False
        )
        # whole tensors as replicated DTensors: load_optimizer_state_dict cuts each rank's shard
        device = get_group_device(self.group)
        mesh = DeviceMesh.from_group(self.group, device.type)
        state = {
            name: {
                "step": torch.tensor(float(step), dtype=torch.float32),
                **{
                    key: DTensor.from_local(
                        states[param][key].to(device), mesh, [Replicate()], run_check=False
                    )
                    for key in STATE_KEYS
                },
            }
            for name, param in named.items()
        }
        name_of = {id(param): name for name, param in named.items()}
        param_groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [name_of[id(p)] for p in group["params"]],
            }
            for group in self.optimizer.param_groups
        ]
        load_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": param_groups})
