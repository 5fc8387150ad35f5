"""The configs of ``mcore-serve``: the server's and each engine process's. Their field metadata
generates the command line (``mcore_parallel.add_dataclass_arguments``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_parallel import ConfigError, config_field


@dataclass
class ServeConfig:
    """Where and how the HTTP front end serves, and how many engine processes it starts."""

    host: str = config_field("127.0.0.1", help="Address to bind (loopback unless told otherwise).")
    port: int = config_field(8000, minimum=1, help="Port to listen on (1-65535).")
    data_parallel_size: int = config_field(1, minimum=1, help="Engines, each with a whole copy of the model.")
    tensor_parallel_size: int = config_field(
        1,
        minimum=1,
        help="Processes per engine that split each layer (it must divide the attention heads, and the "
        "KV heads or be a multiple of them).",
    )
    api_key: str | None = config_field(
        None, help="Require 'Authorization: Bearer KEY' on every route but /health and /metrics."
    )
    served_model_name: str | None = config_field(
        None, help="The model name of the API (default: the model directory's name)."
    )
    max_model_len: int | None = config_field(
        None,
        minimum=1,
        help="Longest prompt plus completion in tokens (default: the model's maximum position).",
    )
    graceful_timeout: float = config_field(
        30.0, minimum=0.0, help="Seconds requests in flight get to finish after SIGTERM or SIGINT."
    )
    engine_startup_timeout: float = config_field(
        600.0, minimum=1.0, help="Seconds to wait for the engine processes to load the model."
    )
    engine_heartbeat_timeout: float = config_field(
        5.0,
        minimum=0.1,
        help="Seconds without a heartbeat after which an engine counts as lost: its requests go to "
        "another engine or fail (engines heartbeat every 0.5 s, during steps too).",
    )
    no_engine_wait: float = config_field(
        10.0,
        minimum=0.0,
        help="Seconds a request waits for an engine while none is live (each was lost; a stalled one "
        "may come back) before it fails with 503.",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = config_field(
        "info", help="uvicorn's log level."
    )

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(["port"], f"must be in 1..65535, got {self.port}")


@dataclass
class EngineProcessConfig:
    """The engine of each data-parallel process: its KV cache and batch limits."""

    kv_cache_memory: float = config_field(
        float(1 << 30),
        help="KV cache per engine: bytes when above 1, else a fraction in (0, 1] of the device's free "
        "memory.",
    )
    block_size: int = config_field(16, minimum=1, help="Tokens per KV cache block.")
    max_requests: int = config_field(64, minimum=1, help="Requests in one engine step at most.")
    max_batch_tokens: int = config_field(512, minimum=1, help="Tokens in one engine step at most.")
    enable_prefix_caching: bool = config_field(
        True, help="Reuse the cache blocks of prompts' shared prefixes."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = config_field(
        "float32", help="Parameter and KV cache precision of the engines."
    )
    seed: int = config_field(0, help="Seed of each engine's sampler (a request's own seed overrides it).")
    pack_cpu_weights: bool = config_field(
        True,
        help="On the CPU in bfloat16, multiply with a copy of the linear weights made for the CPU "
        "(mcore_parallel.set_cpu_weight_packing): oneDNN's blocked layout where it has a bfloat16 "
        "matmul (the same values, faster; a second copy of the weights), else the weights in float32 "
        "(5-6x faster matmuls on AVX2 CPUs; a copy twice the weights' size).",
    )

    def __post_init__(self) -> None:
        if not self.kv_cache_memory > 0:
            raise ConfigError(["kv_cache_memory"], f"must be > 0, got {self.kv_cache_memory}")

    def context_kwargs(self) -> dict:
        """The ``DynamicInferenceEngine`` keyword arguments of this config (``kv_cache_memory``
        as an int of bytes above 1, else as the fraction)."""
        memory = self.kv_cache_memory
        return dict(
            kv_cache_memory=int(memory) if memory > 1 else memory,
            block_size=self.block_size,
            max_requests=self.max_requests,
            max_tokens=self.max_batch_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
        )
