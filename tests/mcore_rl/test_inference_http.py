"""``OpenAIHandle`` against ``mcore-serve`` (a subprocess over loopback, started once for the
module) serving a tiny Hugging Face Llama: its tokens, texts and log-probabilities equal the
in-process ``EngineHandle``'s on the same checkpoint, greedy and seeded, with the server's token
ids (the default) and with the text fallback, an end-of-sequence token included; a URL nobody
listens on fails in under 2 s naming it; requests the server refuses raise naming the URL and its
reason, and a server that refuses or ignores ``return_tokens_as_token_ids`` (a minimal endpoint
in a thread) raises saying to use the fallback."""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mcore_inference import DynamicInferenceEngine
from mcore_models import load_checkpoint_for_inference
from mcore_parallel import find_free_port
from mcore_rl.inference import (
    EndpointUnavailableError,
    EngineHandle,
    GenerationError,
    OpenAIHandle,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "mcore_inference"))
from serve_process import KV_CACHE_BYTES, start_serve, stop_serve, write_tiny_hf_model

pytestmark = pytest.mark.slow  # mcore-serve imports torch and starts an engine process

PROMPTS = ["12+34=", [ord(c) for c in "def fib(n):"]]
TOLERANCE = 1e-5  # the same float32 engine in both processes
EOS = 0  # the tiny Llama's end-of-sequence id
EOS_SAMPLES, EOS_SEED = 8, 0  # some of these samples end on EOS within 48 tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(base URL, in-process EngineHandle of the same checkpoint)``."""
    pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("http-handle")
    model_dir = write_tiny_hf_model(directory / "tiny-llama")
    port = find_free_port()
    args = [str(model_dir), "--data-parallel-size", "1", "--kv-cache-memory", str(KV_CACHE_BYTES)]
    process = start_serve([*args, "--log-level", "warning"], directory, port)
    loaded = load_checkpoint_for_inference(model_dir)
    engine = DynamicInferenceEngine(
        loaded.model, tokenizer=loaded.tokenizer, kv_cache_memory=KV_CACHE_BYTES, freeze_gc=False
    )
    yield f"http://127.0.0.1:{port}", EngineHandle(engine)
    stop_serve(process)


@pytest.mark.parametrize("server_token_ids", [True, False], ids=["token-ids", "text-fallback"])
@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(n=3, temperature=1.0, top_k=30, top_p=0.95, seed=5)],
    ids=["greedy", "seeded"],
)
def test_served_generations_equal_the_in_process_engine(served, sampling, server_token_ids):
    url, engine_handle = served
    handle = OpenAIHandle(url, engine_handle.tokenizer, server_token_ids=server_token_ids)
    assert handle.model == "tiny-llama"
    options = dict(max_tokens=10, ignore_eos=True, **sampling)
    generations = handle.generate(PROMPTS, **options)
    expected = engine_handle.generate(PROMPTS, **options)
    assert [(g.prompt_index, g.sample_index) for g in generations] == [
        (g.prompt_index, g.sample_index) for g in expected
    ]
    assert [g.prompt_ids for g in generations] == [g.prompt_ids for g in expected]
    assert [g.completion_ids for g in generations] == [g.completion_ids for g in expected]
    assert [g.text for g in generations] == [g.text for g in expected]
    assert [g.finish_reason for g in generations] == ["length"] * len(expected)
    for generation, reference in zip(generations, expected, strict=True):
        assert generation.logprobs == pytest.approx(reference.logprobs, abs=TOLERANCE)


def test_a_completion_ended_by_eos_keeps_it_as_in_process(served):
    url, engine_handle = served
    options = dict(n=EOS_SAMPLES, max_tokens=48, temperature=1.0, seed=EOS_SEED)
    generations = OpenAIHandle(url).generate([[49, 50]], **options)  # token ids: no tokenizer needed
    expected = engine_handle.generate([[49, 50]], **options)
    assert [g.completion_ids for g in generations] == [g.completion_ids for g in expected]
    assert [g.finish_reason for g in generations] == [g.finish_reason for g in expected]
    ended = [g for g in generations if g.completion_ids[-1] == EOS]
    assert ended and all(g.finish_reason == "stop" for g in ended)
    for generation, reference in zip(generations, expected, strict=True):
        assert generation.logprobs == pytest.approx(reference.logprobs, abs=TOLERANCE)
    for generation in ended:  # the text leaves the end-of-sequence token out
        assert generation.text == engine_handle.tokenizer.decode(generation.completion_ids[:-1])


def test_stop_strings_cut_the_text_as_in_process(served):
    url, engine_handle = served
    handle = OpenAIHandle(url, engine_handle.tokenizer)
    (free,) = engine_handle.generate(["12+34="], temperature=0, max_tokens=10, ignore_eos=True)
    stop = free.text[2:4]
    (cut,) = handle.generate(["12+34="], temperature=0, max_tokens=10, ignore_eos=True, stop=[stop])
    assert cut.text == free.text[: free.text.find(stop)] and cut.finish_reason == "stop"
    assert cut.completion_ids == free.completion_ids[: len(cut.completion_ids)]


def test_refused_requests_name_the_url_and_the_reason(served):
    url, engine_handle = served
    handle = OpenAIHandle(url, engine_handle.tokenizer)
    with pytest.raises(
        GenerationError, match=rf"{url}/v1/completions answered 400: .*token ids must be in \[0, 128\)"
    ):
        handle.generate([[1, 300]])
    with pytest.raises(ValueError, match=r"model: .* serves \['tiny-llama'\], not 'other'"):
        OpenAIHandle(url, engine_handle.tokenizer, model="other")


class _NoTokenIds(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint without ``return_tokens_as_token_ids``: it serves one model,
    and refuses the field with a 400 naming it (``refuse``) or answers token texts."""

    refuse = True

    def do_GET(self):
        self._answer(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.refuse:
            error = {
                "message": "unsupported parameter: return_tokens_as_token_ids",
                "type": "invalid_request_error",
            }
            self._answer(400, {"error": {**error, "param": "return_tokens_as_token_ids", "code": None}})
        else:
            logprobs = {"tokens": ["1"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}
            self._answer(
                200, {"choices": [{"index": 0, "text": "1", "logprobs": logprobs, "finish_reason": "length"}]}
            )

    def _answer(self, status, body):
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("refuse", [True, False], ids=["refuses", "ignores"])
def test_a_server_without_token_ids_says_to_use_the_fallback(refuse):
    handler = type("Handler", (_NoTokenIds,), {"refuse": refuse})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        reason = "refuses return_tokens_as_token_ids" if refuse else "ignores return_tokens_as_token_ids"
        with pytest.raises(GenerationError, match=rf"{url}.* {reason}.*pass server_token_ids=False"):
            OpenAIHandle(url).generate([[49, 50]], max_tokens=1)
    finally:
        server.shutdown()
        server.server_close()


def test_an_endpoint_that_is_down_fails_fast_naming_its_url():
    url = f"http://127.0.0.1:{find_free_port()}"  # nobody listens there
    start = time.monotonic()
    with pytest.raises(EndpointUnavailableError, match=f"inference endpoint {url}/v1/models is unavailable"):
        OpenAIHandle(url)
    assert time.monotonic() - start < 2.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="base_url: must be an http"):
        OpenAIHandle("localhost:8000", object())
    with pytest.raises(ValueError, match="tokenizer: needed"):
        OpenAIHandle("http://127.0.0.1:1", server_token_ids=False)
