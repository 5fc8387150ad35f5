"""Inference handles: the one interface agents sample through (``generate(prompts, **sampling)``
-> ``Generation`` s with token ids and sampling log-probabilities), over the in-process mcore
engine (``EngineHandle``), any OpenAI-compatible HTTP endpoint (``OpenAIHandle``) or a plain
Hugging Face model (``HFHandle``)."""

from mcore_rl.inference.engine_handle import EngineHandle
from mcore_rl.inference.errors import EndpointUnavailableError, GenerationError, VocabularyMismatchError
from mcore_rl.inference.generation import Generation, InferenceHandle
from mcore_rl.inference.hf_handle import HFHandle
from mcore_rl.inference.http_handle import OpenAIHandle
from mcore_rl.inference.sampling import SamplingOptions
from mcore_rl.inference.vocab import check_vocabulary

__all__ = [
    "EndpointUnavailableError",
    "EngineHandle",
    "Generation",
    "GenerationError",
    "HFHandle",
    "InferenceHandle",
    "OpenAIHandle",
    "SamplingOptions",
    "VocabularyMismatchError",
    "check_vocabulary",
]
