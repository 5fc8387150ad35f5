"""Saving the data gradients (dgrads) and weight gradients (wgrads) of linear-type layers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from mcore_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

_LINEAR_TYPES: tuple[type, ...] = (
    torch.nn.Linear,
    torch.nn.Embedding,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
_TE_LINEAR_NAMES = {"Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"}


def is_linear_type(module: torch.nn.Module) -> bool:
    """torch ``Linear``/``Embedding``, mcore-parallel's parallel linears and embedding, and
    Transformer Engine linears (recognised by module path, so TE is never imported here)."""
    if isinstance(module, _LINEAR_TYPES):
        return True
    cls = type(module)
    return cls.__module__.startswith("transformer_engine") and cls.__name__ in _TE_LINEAR_NAMES


def _tensors(values) -> list[torch.Tensor | None]:
    return [v.detach().clone() if torch.is_tensor(v) else None for v in values]


class DataGradientLogger:
    """Hooks every linear-type submodule of ``model`` and, on every ``every``-th iteration, saves

    * ``dgrad_input[name]``: gradients w.r.t. the module's tensor inputs (``None`` for integer ids),
    * ``dgrad_output[name]``: gradients w.r.t. its outputs,
    * ``wgrad[name.param]``: the parameters' ``.grad`` after backward,

    to ``directory/iter_{iteration:07d}/rank_{rank}.pt`` (a dict of these three dicts; tensor lists
    for the dgrads). Use ``with logger.iteration(i): loss.backward()`` (or ``begin``/``end``).
    """

    def __init__(self, model: torch.nn.Module, directory: str | Path, every: int = 1):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.model = model
        self.directory = Path(directory)
        self.every = every
        self.modules = {name: m for name, m in model.named_modules() if is_linear_type(m)}
        self._iteration: int | None = None
        self._inputs: dict[str, list[torch.Tensor | None]] = {}
        self._outputs: dict[str, list[torch.Tensor | None]] = {}
        self._handles = [
            module.register_full_backward_hook(self._hook(name)) for name, module in self.modules.items()
        ]

    def _hook(self, name: str):
        def record(module, grad_input, grad_output):
            if self._iteration is not None:
                self._inputs[name] = _tensors(grad_input)
                self._outputs[name] = _tensors(grad_output)

        return record

    def begin(self, iteration: int) -> None:
        """Arm the hooks when ``iteration`` is one to log."""
        self._iteration = iteration if iteration % self.every == 0 else None
        self._inputs, self._outputs = {}, {}

    def end(self) -> Path | None:
        """After backward: write the logged iteration's file and return its path (``None`` if not logged)."""
        if self._iteration is None:
            return None
        wgrads = {
            f"{module_name}.{param_name}" if module_name else param_name: p.grad.detach().clone()
            for module_name, module in self.modules.items()
            for param_name, p in module.named_parameters(recurse=False)
            if p.grad is not None
        }
        rank = dist.get_rank() if dist.is_initialized() else 0
        path = self.directory / f"iter_{self._iteration:07d}" / f"rank_{rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"dgrad_input": self._inputs, "dgrad_output": self._outputs, "wgrad": wgrads}, path)
        self._iteration = None
        return path

    @contextlib.contextmanager
    def iteration(self, iteration: int) -> Iterator[None]:
        """``begin(iteration)`` on entry, ``end()`` on a clean exit."""
        self.begin(iteration)
        yield
        self.end()

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
