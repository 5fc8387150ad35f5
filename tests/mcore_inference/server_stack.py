"""A live serving stack for the HTTP server tests: a coordinator, two engine processes
(``coordinator_engine.py``: the conftest's tiny model, vocabulary 128), and uvicorn servers of
``build_app`` in background threads, over loopback; plus the 128-token character tokenizer that
matches the model's vocabulary."""

import asyncio
import threading
import time
from pathlib import Path

import coordinator_engine
import tokenizers
from mcore_inference import InferenceClient, InferenceCoordinator
from mcore_inference.server import build_app, build_server, load_tokenizer
from mcore_models.data import Tokenizer
from mcore_parallel import find_free_port

API_KEY = "test-key"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 1024  # the engines' max_sequence_length
ENGINES = {"engine0": 0.0, "engine1": 0.0}


def write_char_tokenizer(model_dir: Path) -> None:
    """A ``tokenizer.json`` with one token per ASCII character (id = code point) and
    ``<|endoftext|>`` as id 0: 128 ids, like the model."""
    vocab = {"<|endoftext|>": 0, **{chr(c): c for c in range(1, 128)}}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.decoder = tokenizers.decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
    Tokenizer(backend).save(model_dir / "tokenizer.json")


def serve_in_thread(app, graceful_timeout: float = 30.0):
    """``(url, server, thread)``: ``build_server(app)`` on a free port, running in a daemon
    thread, once started (stop it with ``server.should_exit = True``)."""
    port = find_free_port()
    server = build_server(app, port=port, graceful_timeout=graceful_timeout, log_level="warning")
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


class Stack:
    """The coordinator and engines of a test module, and the servers started on them."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.tokenizer = load_tokenizer(model_dir)
        self.coordinator = InferenceCoordinator()
        self.coordinator.start()
        self.processes = coordinator_engine.start_engine_processes(self.coordinator.address, ENGINES)
        self.coordinator.wait_for_engines(len(ENGINES), 120)
        self._servers = []

    def serve(self, address: str | None = None, **kwargs):
        """``(url, server, thread)`` of a new server (own client) on a free port; ``kwargs`` go to
        ``build_app`` (``graceful_timeout`` to ``build_server``)."""
        graceful_timeout = kwargs.pop("graceful_timeout", 30.0)
        client = InferenceClient(address or self.coordinator.address, timeout=kwargs.pop("timeout", 60.0))
        options = {"model_name": MODEL, "max_model_len": MAX_MODEL_LEN, "api_key": API_KEY, **kwargs}
        app = build_app(client, self.tokenizer, **options)
        url, server, thread = serve_in_thread(app, graceful_timeout)
        self._servers.append((server, thread))
        return url, server, thread

    def status(self):
        """The coordinator's status, asked from a client of its own."""
        return self.control("status")

    def control(self, method: str):
        """Call ``InferenceClient.<method>()`` (``status``, ``pause``, ``unpause``, ...) from a
        client of its own; its result."""

        async def call():
            client = InferenceClient(self.coordinator.address, timeout=10)
            try:
                return await getattr(client, method)()
            finally:
                await client.close()

        return asyncio.run(call())

    def close(self) -> None:
        """Stop the servers, end the engines and the coordinator."""
        for server, thread in self._servers:
            server.should_exit = True
            thread.join(10)
        try:
            asyncio.run(asyncio.wait_for(InferenceClient(self.coordinator.address).shutdown(), 10))
        finally:
            self.coordinator.close()
            coordinator_engine.stop_engine_processes(self.processes)
