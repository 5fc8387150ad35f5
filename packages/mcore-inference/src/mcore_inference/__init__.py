"""An in-process, dynamic-batching inference engine with a paged KV cache for models implementing
``mcore_models.InferenceModel``, a ZMQ coordinator with an asyncio client in front of
data-parallel engines, and an OpenAI-compatible HTTP server (``mcore_inference.server``)."""

from importlib.metadata import version as _version

from mcore_inference.attention import paged_attention
from mcore_inference.block_allocator import BlockAllocator, block_hash
from mcore_inference.buckets import InferenceBatchDimensions, build_batch_buckets, match_bucket
from mcore_inference.client import CoordinatorStatus, InferenceClient, RequestResult, StreamOutput
from mcore_inference.context import DynamicInferenceContext
from mcore_inference.coordinator import InferenceCoordinator, broadcast_coordinator_address
from mcore_inference.cuda_graphs import DecodeGraphRunner
from mcore_inference.engine import DynamicInferenceEngine
from mcore_inference.engine_endpoint import EngineEndpoint
from mcore_inference.errors import (
    BlockOverflowError,
    ContextOverflowError,
    CoordinatorError,
    EngineLostError,
    EngineShutdownError,
    IllegalControlSignalError,
    InferenceError,
    InvalidRequestError,
    MaxSequenceLengthOverflowError,
    PipelineStageError,
    ProtocolError,
    RequestOverflowError,
    TokenOverflowError,
)
from mcore_inference.model_runner import DecodeBuffers, DecodeView
from mcore_inference.protocol import PROTOCOL_VERSION, MessageKind
from mcore_inference.request import Request, RequestEvent, RequestEventType, RequestOutput, RequestStatus
from mcore_inference.routing import RoutingPolicy
from mcore_inference.sampler import SampledTokens, filter_logits, sample
from mcore_inference.sampling_params import SamplingParams
from mcore_inference.scheduler import ScheduledChunk, Scheduler
from mcore_inference.serving_state import ServingState

__version__ = _version("mcore-inference")

__all__ = [
    "PROTOCOL_VERSION",
    "BlockAllocator",
    "BlockOverflowError",
    "ContextOverflowError",
    "CoordinatorError",
    "CoordinatorStatus",
    "DecodeBuffers",
    "DecodeGraphRunner",
    "DecodeView",
    "DynamicInferenceContext",
    "DynamicInferenceEngine",
    "EngineEndpoint",
    "EngineLostError",
    "EngineShutdownError",
    "IllegalControlSignalError",
    "InferenceBatchDimensions",
    "InferenceClient",
    "InferenceCoordinator",
    "InferenceError",
    "InvalidRequestError",
    "MaxSequenceLengthOverflowError",
    "MessageKind",
    "PipelineStageError",
    "ProtocolError",
    "Request",
    "RequestEvent",
    "RequestEventType",
    "RequestOutput",
    "RequestOverflowError",
    "RequestResult",
    "RequestStatus",
    "RoutingPolicy",
    "SampledTokens",
    "SamplingParams",
    "ScheduledChunk",
    "Scheduler",
    "ServingState",
    "StreamOutput",
    "TokenOverflowError",
    "__version__",
    "block_hash",
    "broadcast_coordinator_address",
    "build_batch_buckets",
    "filter_logits",
    "match_bucket",
    "paged_attention",
    "sample",
]
