"""``DistributedOptimizer``: Adam/AdamW on float32 main-parameter shards, one per data-parallel rank."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..config.fields import ConfigError
from ..config.optimizer import OptimizerConfig
from ..device import get_group_device
from ..distributed.data_parallel import DistributedDataParallel
from ..distributed.grad_bucket import GradBucket
from ..process_groups.collection import ProcessGroupCollection
from .adam import build_adam_optimizer
from .grad_norm import (
    all_reduce_grad_norm,
    all_reduce_sum,
    counts_toward_expert_grad_norm,
    counts_toward_grad_norm,
    experts_counted_apart,
    sum_of_squares,
)

STATE_KEYS = ("exp_avg", "exp_avg_sq")


class DistributedOptimizer:
    """ZeRO-1: each data-parallel rank owns a ``1/dp`` shard of every bucket and updates only that.

    The float32 main parameters and the Adam moments exist for the owned shard only. ``step()``
    waits for the reduce-scattered gradients, clips them (``clip_grad``: the global norm of the
    whole model, over the data-parallel group and, given ``process_groups``, over the tensor- and
    pipeline-parallel ranks the model is split across), runs Adam (``decoupled_weight_decay=False``) or AdamW, copies the shard into the model's
    (e.g. bfloat16) parameters and all-gathers them. With ``optimizer_cpu_offload`` the first
    ``optimizer_offload_fraction`` of the shard elements keep their main parameters and state on
    the CPU. ``model`` must be built with ``use_distributed_optimizer=True``.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        config: OptimizerConfig | None = None,
        process_groups: ProcessGroupCollection | None = None,
    ):
        if not model.config.use_distributed_optimizer:
            raise ConfigError(
                ["use_distributed_optimizer"],
                "DistributedOptimizer needs a model wrapped with it set to True",
            )
        if model.expert_dp_group is not None and getattr(process_groups, "ep", None) is None:
            raise ConfigError(
                ["expert_model_parallel_size"],
                "a model with expert-parallel gradient buffers needs process_groups with its ep group "
                "(for the gradient norm)",
            )
        self.model = model
        self.config = config if config is not None else OptimizerConfig()
        self.process_groups = process_groups
        self.buckets: list[GradBucket] = model.buckets
        total = sum(bucket.shard_numel for bucket in self.buckets)
        offload_budget = (
            total * self.config.optimizer_offload_fraction if self.config.optimizer_cpu_offload else 0
        )
        self.offloaded_numel = 0
        self.main_params: list[torch.nn.Parameter] = []
        for bucket in self.buckets:
            device = bucket.grad_data.device
            if self.offloaded_numel + bucket.shard_numel <= offload_budget:
                device = torch.device("cpu")
                self.offloaded_numel += bucket.shard_numel
            main = bucket.local_param_view().detach().to(device=device, dtype=torch.float32, copy=True)
            self.main_params.append(torch.nn.Parameter(main))
        self.optimizer = build_adam_optimizer(self.main_params, self.config)

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (set ``lr`` here for schedules)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Zero the model's gradient buffers."""
        self.model.zero_grad_buffer()

    def step(self) -> float:
        """Finish the gradient reduction, update the owned shards and all-gather the parameters.

        Returns the global gradient norm (before clipping).
        """
        self.model.finish_grad_sync()
        for main, bucket in zip(self.main_params, self.buckets, strict=True):
            main.grad = bucket.main_grad_shard.to(device=main.device, dtype=torch.float32)
        norm = self._global_grad_norm()
        if self.config.clip_grad > 0 and norm > self.config.clip_grad:
            for main in self.main_params:
                main.grad.mul_(self.config.clip_grad / (norm + 1e-6))
        self.optimizer.step()
        self._publish_main_params()
        return norm

    def _global_grad_norm(self) -> float:
        """Norm of the whole model's gradient; each element counted once (see ``grad_norm``)."""
        groups = self.process_groups
        tp_group = groups.tp if groups is not None else None
        apart = self.model.expert_dp_group is not None and experts_counted_apart(groups)
        owned, expert_owned = [], []
        for main, bucket in zip(self.main_params, self.buckets, strict=True):
            shard_end = bucket.shard_start + bucket.shard_numel
            expert = bucket.dp_group is not self.model.dp_group  # an expert-parallel buffer's
            for param, offset in bucket.param_offsets.items():
                start, end = max(offset, bucket.shard_start), min(offset + param.numel(), shard_end)
                counted = (
                    counts_toward_expert_grad_norm(param, groups.expert_tp)
                    if apart and expert
                    else counts_toward_grad_norm(param, tp_group)
                )
                if start < end and counted:
                    part = main.grad[start - bucket.shard_start : end - bucket.shard_start]
                    (expert_owned if expert else owned).append(part)
        squares = sum_of_squares(owned)
        model_parallel = groups.mp if groups is not None else None
        if self.model.expert_dp_group is None:
            return all_reduce_grad_norm(squares, [self.model.dp_group, model_parallel])
        if apart:  # experts: over the ranks sharing their gradients, then all experts' slices and stages
            dense = all_reduce_sum(squares, [self.model.dp_group, model_parallel])
            experts = all_reduce_sum(
                sum_of_squares(expert_owned), [self.model.expert_dp_group, groups.tp_ep, groups.pp]
            )
            return math.sqrt((dense + experts.to(dense.device)).item())
        # experts: summed over the ranks sharing their gradients and the ranks holding other experts
        dense = all_reduce_sum(squares, [self.model.dp_group])
        experts = all_reduce_sum(sum_of_squares(expert_owned), [self.model.expert_dp_group, groups.ep])
        return all_reduce_grad_norm(dense + experts.to(dense.device), [model_parallel])

    def _publish_main_params(self) -> None:
        """Copy the main shards into the model parameters and all-gather them."""
        with torch.no_grad():
            for main, bucket in zip(self.main_params, self.buckets, strict=True):
                bucket.local_param_view().copy_(main)
                bucket.all_gather_params()

    def ensure_state(self) -> None:
        """Create zero Adam state for every shard that has none yet (before loading a checkpoint)."""
        for main in self.main_params:
            state = self.optimizer.state[main]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                for key in STATE_KEYS:
                    state[key] = torch.zeros_like(main, memory_format=torch.preserve_format)

    def state_bytes(self) -> int:
        """Bytes this rank holds for the main parameters and the optimizer state."""
        total = sum(main.numel() * main.element_size() for main in self.main_params)
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for k, t in state.items() if k in STATE_KEYS)
        return total

    def gather_param_states(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Every model parameter's float32 ``main`` value and Adam moments, in the parameter's shape.

        Collective over the data-parallel group (all-gathers each bucket's shards over the bucket's
        group: the expert-data-parallel one for expert buffers), for saving.
        """
        self.ensure_state()
        states: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        for main, bucket in zip(self.main_params, self.buckets, strict=True):
            state = self.optimizer.state[main]
            device = get_group_device(bucket.dp_group)
            for key, shard in (("main", main.detach()), *((k, state[k]) for k in STATE_KEYS)):
                full = torch.empty(bucket.grad_data.numel(), dtype=torch.float32, device=device)
                dist.all_gather_into_tensor(full, shard.to(device), group=bucket.dp_group)
                for param, offset in bucket.param_offsets.items():
                    states.setdefault(param, {})[key] = full.narrow(0, offset, param.numel()).view(
                        param.shape
                    )
        return states

    def scatter_param_states(
        self, states: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: int
    ) -> None:
        """Take this rank's shards of full per-parameter states (``gather_param_states``' layout).

        Sets the main parameters, the Adam moments and step, then refreshes the model parameters.
        """
        self.ensure_state()
        for main, bucket in zip(self.main_params, self.buckets, strict=True):
            state = self.optimizer.state[main]
            state["step"].fill_(step)
            targets = {"main": main.data, **{k: state[k] for k in STATE_KEYS}}
            shard_end = bucket.shard_start + bucket.shard_numel
            for param, offset in bucket.param_offsets.items():
                start, end = max(offset, bucket.shard_start), min(offset + param.numel(), shard_end)
                if start >= end:
                    continue
                for key, target in targets.items():
                    source = states[param][key].reshape(-1)[start - offset : end - offset]
                    target[start - bucket.shard_start : end - bucket.shard_start].copy_(source)
        self._publish_main_params()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        steps = [int(state["step"]) for state in self.optimizer.state.values()]
        return steps[0] if steps else 0
