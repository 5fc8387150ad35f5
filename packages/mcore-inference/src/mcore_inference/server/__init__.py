"""The OpenAI-compatible HTTP server in front of an ``InferenceCoordinator``: ``build_app`` makes the
FastAPI app over an ``InferenceClient``, a tokenizer and a model name; ``serve`` runs it under
uvicorn, draining on SIGTERM."""

from mcore_inference.server.admission import Admission
from mcore_inference.server.app import build_app
from mcore_inference.server.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)
from mcore_inference.server.errors import OpenAIError
from mcore_inference.server.metrics import ServerMetrics
from mcore_inference.server.serve import DrainingServer, build_server, serve
from mcore_inference.server.text_assembler import TextAssembler
from mcore_inference.server.tokenizer import ServingTokenizer, TokenizerAdapter, load_tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "Admission",
    "ChatTemplate",
    "ChatTemplateError",
    "DrainingServer",
    "OpenAIError",
    "ServerMetrics",
    "ServingTokenizer",
    "TextAssembler",
    "TokenizerAdapter",
    "build_app",
    "build_server",
    "load_chat_template",
    "load_tokenizer",
    "serve",
]
