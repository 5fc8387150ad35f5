"""``MoESubmodules``: the specs an MoE layer is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_api import experimental_api

from .router import TopKRouter
from .router_interface import RouterBuilder


@experimental_api
@dataclass
class MoESubmodules:
    """``experts``: spec or class of the routed experts (``SequentialExperts``/``GroupedExperts``),
    called with ``(config, num_local_experts=...)``. ``router``: any ``RouterBuilder``.
    ``shared_experts``: spec of the expert every token passes through, or ``None``."""

    experts: Any = None
    router: RouterBuilder = TopKRouter
    shared_experts: Any = None
