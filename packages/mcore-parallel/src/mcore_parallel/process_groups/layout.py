"""The dense and expert rank grids of a model-parallel layout, validated against the world size."""

from __future__ import annotations

from .hyper_comm_grid import HyperCommGrid

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""The default ``order`` of the rank grid: tensor, context, expert, data, pipeline, fastest-varying first."""

_ORDER_DIMS = frozenset({"tp", "cp", "ep", "dp", "pp"})


def make_parallel_grids(
    world_size: int,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    order: str = DEFAULT_ORDER,
) -> tuple[HyperCommGrid, HyperCommGrid]:
    """The dense grid (dims ``tp, cp, dp, pp``) and the expert grid (dims ``tp, ep, dp, pp``) of a layout.

    ``order`` lists the five dimensions fastest-varying first. The dense grid drops ``ep`` from it;
    the expert grid drops ``cp`` and factors the same ranks as expert-TP x EP x expert-DP x PP, with
    the same pipeline groups as the dense grid. Data-parallel sizes are what the world leaves over.
    ``expert_tensor_parallel_size`` defaults to ``tensor_model_parallel_size``.

    Raises:
        ValueError: a size is below 1, the sizes do not divide ``world_size`` (the message names every
            size and the world size), ``order`` is not a permutation of ``tp, cp, ep, dp, pp``, or
            the order gives experts different pipeline groups from the dense layers.
    """
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tensor_model_parallel_size
    sizes = {
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "context_parallel_size": context_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
        "expert_tensor_parallel_size": expert_tensor_parallel_size,
    }
    for name, value in {"world_size": world_size, **sizes}.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    dims = order.split("-")
    if sorted(dims) != sorted(_ORDER_DIMS):
        raise ValueError(f"order must be a '-'-separated permutation of tp, cp, ep, dp, pp; got {order!r}")

    dense_model = tensor_model_parallel_size * context_parallel_size * pipeline_model_parallel_size
    expert_model = expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size
    if world_size % dense_model or world_size % expert_model:
        listed = ", ".join(f"{name}={value}" for name, value in sizes.items())
        raise ValueError(
            f"world size {world_size} must be divisible by tensor x context x pipeline parallel sizes "
            f"({dense_model}) and by expert-tensor x expert x pipeline parallel sizes ({expert_model}); "
            f"got {listed}"
        )
    dense_sizes = {
        "tp": tensor_model_parallel_size,
        "cp": context_parallel_size,
        "dp": world_size // dense_model,
        "pp": pipeline_model_parallel_size,
    }
    expert_sizes = {
        "tp": expert_tensor_parallel_size,
        "ep": expert_model_parallel_size,
        "dp": world_size // expert_model,
        "pp": pipeline_model_parallel_size,
    }
    dense_dims = [d for d in dims if d != "ep"]
    expert_dims = [d for d in dims if d != "cp"]
    dense = HyperCommGrid([dense_sizes[d] for d in dense_dims], dense_dims)
    expert = dense.view([expert_sizes[d] for d in expert_dims], expert_dims)
    if dense.rank_groups("pp") != expert.rank_groups("pp"):
        raise ValueError(
            f"order {order!r} gives expert layers different pipeline groups from dense layers; "
            "put pp after the dimensions whose sizes differ between them"
        )
    return dense, expert
