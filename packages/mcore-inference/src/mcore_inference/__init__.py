"""An in-process, dynamic-batching inference engine with a paged KV cache for models implementing
``mcore_models.InferenceModel`` (a ZMQ coordinator and an HTTP server are planned, not here yet)."""

from importlib.metadata import version as _version

from mcore_inference.attention import paged_attention
from mcore_inference.block_allocator import BlockAllocator, block_hash
from mcore_inference.buckets import InferenceBatchDimensions, build_batch_buckets, match_bucket
from mcore_inference.context import DynamicInferenceContext
from mcore_inference.cuda_graphs import DecodeGraphRunner
from mcore_inference.engine import DynamicInferenceEngine
from mcore_inference.errors import (
    BlockOverflowError,
    ContextOverflowError,
    EngineShutdownError,
    InferenceError,
    InvalidRequestError,
    MaxSequenceLengthOverflowError,
    PipelineStageError,
    RequestOverflowError,
    TokenOverflowError,
)
from mcore_inference.model_runner import DecodeBuffers, DecodeView
from mcore_inference.request import Request, RequestEvent, RequestEventType, RequestOutput, RequestStatus
from mcore_inference.sampler import SampledTokens, filter_logits, sample
from mcore_inference.sampling_params import SamplingParams
from mcore_inference.scheduler import ScheduledChunk, Scheduler

__version__ = _version("mcore-inference")

__all__ = [
    "BlockAllocator",
    "BlockOverflowError",
    "ContextOverflowError",
    "DecodeBuffers",
    "DecodeGraphRunner",
    "DecodeView",
    "DynamicInferenceContext",
    "DynamicInferenceEngine",
    "EngineShutdownError",
    "InferenceBatchDimensions",
    "InferenceError",
    "InvalidRequestError",
    "MaxSequenceLengthOverflowError",
    "PipelineStageError",
    "Request",
    "RequestEvent",
    "RequestEventType",
    "RequestOutput",
    "RequestOverflowError",
    "RequestStatus",
    "SampledTokens",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "TokenOverflowError",
    "__version__",
    "block_hash",
    "build_batch_buckets",
    "filter_logits",
    "match_bucket",
    "paged_attention",
    "sample",
]
