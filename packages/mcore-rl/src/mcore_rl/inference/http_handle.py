"""An inference handle over any OpenAI-compatible ``/v1/completions`` endpoint (``mcore-serve``,
vLLM, ...), with the standard library's HTTP client."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mcore_api import experimental_api

from .errors import EndpointUnavailableError, GenerationError, VocabularyMismatchError
from .generation import Generation, Prompt
from .prompts import prompt_token_ids
from .sampling import SamplingOptions
from .vocab import tokenizer_size

_TOKEN_ID_PREFIX = "token_id:"
_TOKEN_IDS_FIELD = "return_tokens_as_token_ids"
_MAX_CONCURRENT_REQUESTS = 64
_FALLBACK = "pass server_token_ids=False and a tokenizer to map the token texts back to ids"


@experimental_api
class OpenAIHandle:
    """``generate`` through ``POST {base_url}/v1/completions``: one request per call (one per
    prompt, sent concurrently, when seeded: see ``SamplingOptions.seed``), prompts sent as token
    ids (texts are encoded with ``tokenizer`` first), ``n`` choices each, ``logprobs=0`` for the
    sampled tokens' log-probabilities.

    The completion's token ids come back one of two ways:

    - ``server_token_ids=True`` (default; ``mcore-serve`` and vLLM): the request asks
      ``return_tokens_as_token_ids`` and the ids are read from the ``token_id:N`` names of the
      ``logprobs`` object; no tokenizer needed for token-id prompts. A server that refuses the
      field (or ignores it) raises ``GenerationError`` saying so;
    - ``server_token_ids=False`` (the fallback for such servers): the token texts are mapped back
      to ids with ``tokenizer`` (required); a text that several ids decode to is refused
      (``GenerationError``), so it only suits tokenizers whose tokens decode to distinct texts
      (not byte-level BPE).

    A completion that an end-of-sequence token ended keeps it, as the in-process handles do
    (``mcore-serve`` and vLLM list it last in ``logprobs``; the text leaves it out).

    The endpoint is asked ``GET /v1/models`` when the handle is built: one that is down fails
    within ``connect_timeout`` seconds with ``EndpointUnavailableError`` naming the URL; so does
    every later call that cannot connect. ``timeout`` bounds the wait for an answer. A request
    the server refuses raises ``GenerationError`` with its status and message. A returned id the
    tokenizer does not have raises ``VocabularyMismatchError``. ``model`` defaults to the
    endpoint's first model; ``api_key`` is sent as a bearer token."""

    def __init__(
        self,
        base_url: str,
        tokenizer: Any | None = None,
        *,
        model: str | None = None,
        api_key: str | None = None,
        server_token_ids: bool = True,
        connect_timeout: float = 2.0,
        timeout: float = 600.0,
    ):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"base_url: must be an http(s) URL such as http://127.0.0.1:8000, got {base_url!r}"
            )
        if not server_token_ids and tokenizer is None:
            raise ValueError("tokenizer: needed to map token texts back to ids when server_token_ids=False")
        self.base_url, self._parts = base_url.rstrip("/"), parts
        self.tokenizer, self.server_token_ids = tokenizer, server_token_ids
        self.api_key, self.connect_timeout, self.timeout = api_key, connect_timeout, timeout
        self._piece_ids: dict[str, int | None] | None = None
        served = [m["id"] for m in self._request("GET", "/v1/models")["data"]]
        if model is not None and model not in served:
            raise ValueError(f"model: {self.base_url} serves {served}, not {model!r}")
        self.model = model if model is not None else served[0]

    def generate(self, prompts: Sequence[Prompt], **sampling: Any) -> list[Generation]:
        """``n`` completions of each prompt (``sampling``: the fields of ``SamplingOptions``)."""
        options = SamplingOptions(**sampling)
        ids = prompt_token_ids(prompts, self.tokenizer)
        if options.seed is None:
            return self._completions(ids, 0, options)
        # a server seeds choice j of every prompt of a request alike: one request per prompt
        with ThreadPoolExecutor(min(len(ids), _MAX_CONCURRENT_REQUESTS) or 1) as pool:
            parts = pool.map(lambda i: self._completions(ids[i : i + 1], i, options), range(len(ids)))
            return [g for part in parts for g in part]

    def _completions(self, ids: list[list[int]], first: int, options: SamplingOptions) -> list[Generation]:
        """The generations of one request for ``ids``, prompts ``first``, ``first + 1``, ... of
        the call (seeded as prompt ``first``'s)."""
        body = self._request("POST", "/v1/completions", self._body(ids, options, options.prompt_seed(first)))
        choices = sorted(body["choices"], key=lambda c: c["index"])
        if len(choices) != len(ids) * options.n:
            raise GenerationError(
                f"{self.base_url}: {len(choices)} choices for {len(ids)} prompts x n={options.n}"
            )
        return [self._generation(c, ids, first, options.n) for c in choices]

    def _body(self, ids: list[list[int]], options: SamplingOptions, seed: int | None) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": ids,
            "n": options.n,
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "top_k": options.top_k or -1,
            "seed": seed,
            "stop": list(options.stop) or None,
            "ignore_eos": options.ignore_eos or None,
            "logprobs": 0,
        }
        if self.server_token_ids:
            body[_TOKEN_IDS_FIELD] = True
        return {key: value for key, value in body.items() if value is not None}

    def _generation(self, choice: dict[str, Any], ids: list[list[int]], first: int, n: int) -> Generation:
        index, sample = divmod(choice["index"], n)
        logprobs = choice.get("logprobs") or {}
        pieces, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        tokens = [self._token_id(piece, first + index) for piece in pieces]
        return Generation(
            prompt_ids=ids[index],
            completion_ids=tokens,
            text=choice.get("text"),
            logprobs=[float(v) for v in values],
            finish_reason=choice.get("finish_reason") or "stop",
            prompt_index=first + index,
            sample_index=sample,
        )

    def _token_id(self, piece: str, index: int) -> int:
        if self.server_token_ids:
            number = piece.removeprefix(_TOKEN_ID_PREFIX)
            if number == piece or not number.isdigit():
                raise GenerationError(
                    f"{self.base_url}: prompt {index}: token {piece!r} is not 'token_id:N': the server "
                    f"ignores {_TOKEN_IDS_FIELD}; {_FALLBACK}"
                )
            token = int(number)
        else:
            token = self._piece_table().get(piece)
            if token is None:
                raise GenerationError(
                    f"{self.base_url}: prompt {index}: the token text {piece!r} matches no single id of the "
                    "tokenizer; use server_token_ids=True with a server that returns token ids"
                )
        if self.tokenizer is not None and token >= tokenizer_size(self.tokenizer):
            raise VocabularyMismatchError(
                f"{self.base_url} sampled token id {token}, outside the tokenizer's {tokenizer_size(self.tokenizer)} ids"
            )
        return token

    def _piece_table(self) -> dict[str, int | None]:
        """Each token's text alone -> its id (``None`` for a text several ids decode to)."""
        if self._piece_ids is None:
            table: dict[str, int | None] = {}
            for token in range(tokenizer_size(self.tokenizer)):
                piece = self.tokenizer.decode([token])
                table[piece] = None if piece in table else token
            self._piece_ids = table
        return self._piece_ids

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON answer to one request; ``EndpointUnavailableError`` when there is none,
        ``GenerationError`` for an error status."""
        url = self.base_url + path
        connection_type = (
            http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        )
        connection = connection_type(self._parts.hostname, self._parts.port, timeout=self.connect_timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        prefix = self._parts.path.rstrip("/")
        try:
            connection.connect()
            connection.sock.settimeout(self.timeout)
            connection.request(method, prefix + path, None if body is None else json.dumps(body), headers)
            response = connection.getresponse()
            status, payload = response.status, response.read()
        except (OSError, http.client.HTTPException) as error:
            reason = "timed out" if isinstance(error, socket.timeout) else f"{type(error).__name__}: {error}"
            raise EndpointUnavailableError(f"inference endpoint {url} is unavailable: {reason}") from error
        finally:
            connection.close()
        answer = _json(payload, url)
        if status != 200:
            raise self._refusal(url, status, answer, payload)
        return answer

    def _refusal(self, url: str, status: int, answer: Any, payload: bytes) -> GenerationError:
        """The error of an answer with an error ``status``: its message, and what to do when the
        server refused ``return_tokens_as_token_ids``."""
        error = answer.get("error") if isinstance(answer, dict) else None
        error = error if isinstance(error, dict) else {}
        message = f"{url} answered {status}: {error.get('message') or payload[:200]!r}"
        if self.server_token_ids and _TOKEN_IDS_FIELD in f"{error.get('param')} {error.get('message')}":
            return GenerationError(
                f"{url} refuses {_TOKEN_IDS_FIELD}, so it returns no token ids; {_FALLBACK} ({message})"
            )
        return GenerationError(message)


def _json(payload: bytes, url: str) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        raise GenerationError(f"{url} answered with something that is not JSON: {payload[:200]!r}") from None
