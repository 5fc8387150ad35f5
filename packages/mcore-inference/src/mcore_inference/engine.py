"""The in-process engine: requests in, one mixed prefill/decode forward per step, tokens out."""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from mcore_models import InferenceModel
from mcore_parallel import ProcessGroupCollection

from .async_driver import AsyncDriver
from .buckets import InferenceBatchDimensions
from .context import DynamicInferenceContext
from .cuda_graphs import graph_runner_for
from .errors import EngineShutdownError, InvalidRequestError, MaxSequenceLengthOverflowError, is_transient
from .model_runner import ModelRunner
from .pipeline import PipelineStage, model_groups
from .request import Request, RequestEventType, RequestOutput, RequestStatus
from .request_intake import (
    check_model,
    prompts_with_params,
    resolve_eos_token_ids,
    tokenize,
    validate_request,
)
from .sampling_params import SamplingParams
from .scheduler import ScheduledChunk, Scheduler
from .step_sampling import StepSampler, prompt_logprobs
from .stopping import stop_reason

OutputCallback = Callable[[RequestOutput], None]

_logger = logging.getLogger(__name__)


@functools.cache
def _unfreeze_gc_at_exit() -> None:
    # the interpreter's last collections then reclaim the frozen objects (extension modules
    # report what they see leaked at exit)
    atexit.register(gc.unfreeze)


def _freeze_gc_heap() -> None:
    """Collect garbage, then freeze every object alive (see ``DynamicInferenceEngine``'s ``freeze_gc``)."""
    gc.collect()
    gc.freeze()
    _unfreeze_gc_at_exit()


class DynamicInferenceEngine:
    """Continuous batching over a paged KV cache for a model implementing
    ``mcore_models.InferenceModel`` (e.g. an ``mcore_models.GPTModel``).

    ``add_request`` queues a prompt (token ids, or text with ``tokenizer``) and returns its
    ``Request``, whose ``result()`` blocks until it is done. Each ``step()`` schedules decodes,
    then prefill chunks within the token budget, runs one forward over the mixed batch and samples
    every request that reached the end of its tokens. ``generate`` steps until a list of prompts is
    done; ``stream``/``generate_async`` do the same from a running asyncio loop, stepping in a
    worker thread. A request that cannot be served (bad input, or NaN/inf logits or a failed draw
    at sampling time) fails alone with a non-transient error event and frees its blocks; the
    others continue. ``abort(request_id)`` ends a request as ``ABORTED`` at the next step boundary,
    and so does leaving a ``stream`` or cancelling a ``generate_async`` task before it finished.
    A forward that raises a ``RuntimeError`` or ``OSError`` (a device or collective hiccup) is
    retried by recomputing the step's requests, up to ``max_transient_retries`` times; any other
    exception (a programming error) fails the step's requests and is raised by ``step()``.

    The engine uses only the members of ``InferenceModel`` and never changes the model: it must be
    in eval mode (else ``ValueError``; a model lacking a member of the protocol is refused with a
    ``TypeError`` naming it). ``model`` may be one pipeline stage (``pre_process`` /
    ``post_process`` of its rank in the pipeline group): the stages pass hidden states on and the
    last one broadcasts its logits to all (``PipelineStage.forward``; a forward that raises on one
    stage makes every rank raise, and retry or fail the step's requests alike, by that error's
    kind). Every rank of the model
    replica runs its own engine with the same requests added in the same order, and every rank
    samples; they all take the tokens and log-probabilities of the first tensor-parallel rank of
    the last stage, so each rank's ``Request`` objects hold the same results. The groups are
    ``pg_collection``, else the global ones of ``initialize_model_parallel`` if ``model`` uses
    them. ``context`` defaults to ``DynamicInferenceContext.from_model(model, pg_collection=...,
    **context_kwargs)``.

    A hybrid model (one with ``mamba_state_config``, see ``mamba_state_config_of``) also gets a
    Mamba state slot per request in the context, restarted whenever the request is recomputed from
    its first token; prefix caching is then off and ``cuda_graphs`` refused (see
    ``DynamicInferenceContext``).

    Requests stop at an end-of-sequence id unless their ``SamplingParams.ignore_eos``: the ids
    are ``eos_token_id`` (one id or a list; ``[]`` for none), else the model's ``eos_token_ids``,
    else the tokenizer's ``eod_id``, else none. An id outside the vocabulary is a ``ValueError``.

    ``cuda_graphs`` (``True``: ``build_batch_buckets(max_requests, max_tokens)``, or a list of
    buckets) runs decode-only steps padded to the decode-only buckets through CUDA graphs (see
    ``DecodeGraphRunner``); steps with a prefill chunk run eagerly. On a CPU model the padded
    steps run eagerly, with a warning. Not with pipeline stages.

    ``freeze_gc`` (default ``True``) ends the construction with a full garbage collection and
    ``gc.freeze()``: the objects alive then (the model's, the engine's, the caller's) are never
    scanned again by Python's cyclic collector, whose full collections of a loaded model's heap
    otherwise stall a step (a few per run, ~46 ms each: 8% of the in-process benchmark's tokens/s).
    Like vLLM's engine, this is process-wide: a reference cycle among those objects is then never
    reclaimed; pass ``False`` to leave the collector as it is.

    On the CPU in bfloat16, turn on ``mcore_parallel.set_cpu_weight_packing(model, True)`` before
    building the engine (``mcore-serve`` does by default): the model's linear layers then multiply
    with weights kept in oneDNN's blocked layout where oneDNN has a bfloat16 matmul (same values as
    ``F.linear``, 9-13% more tokens/s in ``benchmarks/inference_throughput.py`` on AVX-512/AMX),
    else kept in float32 (AVX2 CPUs, where a bfloat16 matmul is 6-8x slower than a float32 one:
    1.8x the tokens/s there).
    """

    def __init__(
        self,
        model: InferenceModel,
        context: DynamicInferenceContext | None = None,
        *,
        tokenizer: Any | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int = 0,
        max_transient_retries: int = 2,
        cuda_graphs: bool | Sequence[InferenceBatchDimensions] = False,
        pg_collection: ProcessGroupCollection | None = None,
        freeze_gc: bool = True,
        **context_kwargs: Any,
    ):
        check_model(model)
        if not isinstance(freeze_gc, bool):
            raise TypeError(f"freeze_gc must be a bool, got {type(freeze_gc).__name__}")
        self.model = model
        self.context = (
            context
            if context is not None
            else DynamicInferenceContext.from_model(model, pg_collection=pg_collection, **context_kwargs)
        )
        self.scheduler = Scheduler(self.context)
        self.vocab_size = model.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = resolve_eos_token_ids(eos_token_id, model, tokenizer, self.vocab_size)
        self.max_transient_retries = max_transient_retries
        tp_group = model.tp_group
        self._tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self._pipeline = PipelineStage.of(model, model_groups(model, pg_collection))
        self.runner = ModelRunner(model, self.context, self._pipeline)
        self._sampler = StepSampler(torch.Generator().manual_seed(seed), self._tp_group, self._pipeline)
        self._ids = itertools.count()
        self._incoming: deque[Request] = deque()  # appended from any thread, drained by step()
        self._callbacks: dict[int, OutputCallback] = {}
        self._unfinished: dict[int, Request] = {}  # valid requests not yet finished, by id
        self._last_id = -1
        self._aborts: deque[int] = deque()  # request ids to abort at the next step boundary
        self._stepping = False
        self._retries: dict[int, int] = {}
        self._lock = threading.RLock()
        self._async = AsyncDriver(self, self._fail_unfinished)
        self._suspended = False
        self._shutdown = False
        self._weight_version = 0
        self.step_count = 0
        self.graph_runner = graph_runner_for(model, self.context, cuda_graphs, self._pipeline)
        if freeze_gc:
            _freeze_gc_heap()

    @property
    def eos_token_id(self) -> int | None:
        """The first of ``eos_token_ids``, or ``None`` when there are none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: Sequence[int] | str,
        sampling_params: SamplingParams | None = None,
        *,
        on_output: OutputCallback | None = None,
    ) -> Request:
        """Queue ``prompt``; ``on_output`` is called (from the stepping thread) with every new
        token and once when the request finishes (a callback that raises fails its request).

        Whatever the caller sends, an invalid request is not raised but returned already
        ``FAILED``: its ``error`` reads ``"InvalidRequestError: <field>: <what is allowed>"``, its
        ``on_output`` was called once with the finished output and dropped, its ``result()``
        returns at once, and it holds no blocks. That covers a prompt that is not a string or a
        list of ints (floats, ``None``, nested lists, a scalar), ``sampling_params`` that is not a
        ``SamplingParams`` (a ``dict`` too) and every field of it of the wrong type or out of range
        (see ``SamplingParams.validate``). After ``shutdown()`` this raises
        ``EngineShutdownError``."""
        if self._shutdown:
            raise EngineShutdownError("the engine was shut down")
        params = SamplingParams() if sampling_params is None else sampling_params
        text = prompt if isinstance(prompt, str) else None
        request = Request(next(self._ids), [], params, prompt_text=text)
        self._last_id = max(self._last_id, request.request_id)
        request.add_event(RequestEventType.ADD)
        if on_output is not None:
            self._callbacks[request.request_id] = on_output
        try:
            if not isinstance(params, SamplingParams):
                raise InvalidRequestError(
                    "sampling_params", f"must be a SamplingParams or None, got {type(params).__name__}"
                )
            request.prompt_tokens = tokenize(prompt, self.tokenizer)
            request.tokens = list(request.prompt_tokens)
            validate_request(request, self.vocab_size, self.tokenizer, self.context)
        except (InvalidRequestError, MaxSequenceLengthOverflowError) as error:
            self._fail(request, f"{type(error).__name__}: {error}")
            return request
        if params.prompt_logprobs:
            request.prompt_logprobs = [None]  # the first token has no context
            if params.top_n_logprobs:
                request.prompt_top_logprobs = [None]
        self._unfinished[request.request_id] = request
        self._incoming.append(request)
        return request

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued, waiting or active."""
        return bool(self._incoming) or self.scheduler.has_work()

    def abort(self, request_id: int) -> bool:
        """End request ``request_id`` as ``ABORTED`` and free its blocks; thread-safe.

        It takes effect at once when no step is running, else at the start of the next step
        (never in the middle of one): the request gets an ``abort`` event and ``finish_reason``
        ``"abort"``, keeps the tokens generated so far, its ``on_output`` is called a last time
        with ``finished=True`` and its ``result()`` returns. The other requests are unaffected.
        Returns ``True`` if the request was unfinished (so it will be aborted), ``False`` if it had
        already finished (a no-op: aborting races with finishing). An id this engine never issued
        raises ``InvalidRequestError`` naming ``request_id``."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise InvalidRequestError("request_id", f"must be an int, got {type(request_id).__name__}")
        request = self._unfinished.get(request_id)
        if request is None:
            if 0 <= request_id <= self._last_id:
                return False
            raise InvalidRequestError("request_id", f"no request {request_id} was added to this engine")
        self._aborts.append(request_id)
        if self._lock.acquire(blocking=False):  # not stepping in another thread
            try:
                if not self._stepping:  # nor in a callback of this thread's step
                    self._apply_aborts()
            finally:
                self._lock.release()
        return True

    def _apply_aborts(self) -> None:
        """Abort the requests queued by ``abort`` (with the lock held, between steps)."""
        while self._incoming:
            self.scheduler.add(self._incoming.popleft())
        while self._aborts:
            request = self._unfinished.get(self._aborts.popleft())
            if request is None or request.finished:
                continue
            request.status = RequestStatus.ABORTED
            request.finish_reason = "abort"
            if self.tokenizer is not None and request.generated_text is None:
                request.generated_text = self.tokenizer.decode(request.generated_tokens)
            request.add_event(RequestEventType.ABORT)
            self._close(request, [])

    # ----------------------------------------------------------------- stepping
    def step(self) -> list[Request]:
        """Run one forward over the next batch; return the requests that finished in it."""
        with self._lock:
            self._apply_aborts()  # also moves the incoming requests to the scheduler
            if self._suspended or self._shutdown:
                return []
            chunks = self.scheduler.schedule()
            if not chunks:
                return []
            self.step_count += 1
            self._stepping = True
            try:
                return self._run(chunks)
            finally:
                self._stepping = False

    def _run(self, chunks: Sequence[ScheduledChunk]) -> list[Request]:
        try:
            padded = self.graph_runner.run(chunks) if self.graph_runner is not None else None
            if padded is not None:
                logits, logits_slices = padded
            else:
                logits, logits_slices = self.runner.run(chunks)
        except Exception as error:
            # Every pipeline stage classifies a failure alike (PipelineStage.forward passes its
            # kind on), so all stages retry or all fail the same requests.
            if is_transient(error):  # recompute, a few times
                return self._retry(chunks, error)
            self._fail_step(chunks, error)
            raise
        try:
            return self._advance(chunks, logits, logits_slices)
        except Exception as error:  # an engine bug: leave no request half-advanced, then surface it
            self._fail_step(chunks, error)
            raise

    def _fail_step(self, chunks: Sequence[ScheduledChunk], error: Exception) -> None:
        """Fail this step's unfinished requests with ``error`` (which the step then raises)."""
        for chunk in chunks:
            if not chunk.request.finished:
                self._fail(chunk.request, f"{type(error).__name__}: {error}")

    def _retry(self, chunks: Sequence[ScheduledChunk], error: Exception) -> list[Request]:
        failed = []
        for chunk in chunks:
            request = chunk.request
            count = self._retries[request.request_id] = self._retries.get(request.request_id, 0) + 1
            message = f"{type(error).__name__}: {error}"
            if count > self.max_transient_retries:
                self._fail(request, f"{message} (after {count - 1} retries)")
                failed.append(request)
            else:
                request.add_event(RequestEventType.ERROR_TRANSIENT, message)
                self.scheduler.preempt(request)
        return failed

    def _advance(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor, logits_slices: Sequence[slice]
    ) -> list[Request]:
        # Sample first, changing no request, so that an exception leaves none half-advanced.
        sampling = [
            (chunk.request, rows.stop - 1)
            for chunk, rows in zip(chunks, logits_slices, strict=True)
            if chunk.end == len(chunk.request.tokens)
            and chunk.end < chunk.request.sampling_params.max_total_length(len(chunk.request.prompt_tokens))
        ]
        requests = [r for r, _ in sampling]
        sampled, errors = self._sampler.sample([row for _, row in sampling], requests, logits)
        sampled_ids = {r.request_id for r in requests}
        for chunk, rows in zip(chunks, logits_slices, strict=True):
            request = chunk.request
            if chunk.logits == "all":
                prompt_logprobs(chunk, logits[rows])
            request.num_computed_tokens = chunk.end
            if request.request_id not in errors:  # NaN logits may come with NaN keys/values
                self.scheduler.register_full_blocks(request)
            if chunk.end == len(request.tokens) and request.request_id not in sampled_ids:
                self._complete(request, "length")  # nothing to generate (num_tokens_to_generate=0)
        now = time.time()
        for i, request in enumerate(requests):
            if request.request_id in errors:
                self._fail(request, errors[request.request_id])
                continue
            token = sampled.tokens[i]
            request.tokens.append(token)
            request.generated_tokens.append(token)
            request.token_timestamps.append(now)
            if request.sampling_params.logprobs:
                request.generated_logprobs.append(sampled.logprobs[i])
            if request.sampling_params.top_n_logprobs:
                request.generated_top_logprobs.append(sampled.top_logprobs[i])
            if len(request.generated_tokens) == 1:
                request.add_event(RequestEventType.FIRST_TOKEN)
            reason = stop_reason(request, token, self.eos_token_ids, self.tokenizer)
            if reason is None:
                self._emit(request, [token])
            else:
                self._complete(request, reason, [token])
        return [chunk.request for chunk in chunks if chunk.request.finished]

    def _emit(self, request: Request, new_tokens: list[int]) -> None:
        callback = self._callbacks.get(request.request_id)
        if callback is None:
            return
        try:
            callback(RequestOutput(request, new_tokens, request.finished))
        except Exception as error:  # the caller's callback: it fails its request, not the step
            self._callbacks.pop(request.request_id, None)
            _logger.exception("on_output of request %d raised", request.request_id)
            if not request.finished:
                self._fail(request, f"on_output raised {type(error).__name__}: {error}")

    def _close(self, request: Request, new_tokens: list[int]) -> None:
        self.scheduler.finish(request)
        self._retries.pop(request.request_id, None)
        self._unfinished.pop(request.request_id, None)
        self._emit(request, new_tokens)
        self._callbacks.pop(request.request_id, None)
        request.future.set_result(request)

    def _complete(self, request: Request, reason: str, new_tokens: Sequence[int] = ()) -> None:
        request.status = RequestStatus.COMPLETED
        request.finish_reason = reason
        if self.tokenizer is not None and request.generated_text is None:
            request.generated_text = self.tokenizer.decode(request.generated_tokens)
        request.add_event(RequestEventType.FINISH, reason)
        self._close(request, list(new_tokens))

    def _fail(self, request: Request, message: str) -> None:
        request.status = RequestStatus.FAILED
        request.finish_reason = "error"
        request.error = message
        request.add_event(RequestEventType.ERROR_NONTRANSIENT, message)
        request.add_event(RequestEventType.FAIL, message)
        self._close(request, [])

    # ----------------------------------------------------------------- blocking and async use
    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Request]:
        """Add ``prompts`` (one ``SamplingParams`` for all, or a list of one each) and step until
        all are done. An invalid prompt or parameter fails its request alone (see
        ``add_request``); a single prompt instead of a list of them, or a list of parameters of
        another length, raises ``InvalidRequestError``."""
        requests = [self.add_request(p, s) for p, s in prompts_with_params(prompts, sampling_params)]
        while not all(r.finished for r in requests):
            if self._suspended:
                raise RuntimeError("the engine is suspended; resume() it before generating")
            self.step()
        return requests

    def stream(
        self, prompt: Sequence[int] | str, sampling_params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield a ``RequestOutput`` per new token of ``prompt``, the last with ``finished=True``.

        Must run inside an asyncio loop; steps happen in a worker thread driven by one task per
        loop, so any number of streams (and calls over time) share the batch. Leaving the stream
        before its last output (``break``, ``aclose()``, the iterator garbage collected, the
        consuming task cancelled) aborts the request (see ``abort``), which frees its blocks at
        the next step boundary."""
        return self._async.stream(prompt, sampling_params)

    async def generate_async(
        self, prompt: Sequence[int] | str, sampling_params: SamplingParams | None = None
    ) -> Request:
        """Await the finished ``Request`` of ``prompt`` (see ``stream``); cancelling the awaiting
        task aborts the request."""
        return await self._async.generate(prompt, sampling_params)

    def _fail_unfinished(self, message: str) -> None:
        with self._lock:
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
            for request in [*self.scheduler.active, *self.scheduler.waiting]:
                self._fail(request, message)

    # ----------------------------------------------------------------- new weights
    def update_weights(self, load: Callable[[InferenceModel], None]) -> int:
        """Run ``load(model)``, which writes new values into the model's parameters, between
        steps; then drop every cached prefix block (its keys and values came from the old
        weights), so later prompts are computed afresh. Returns the new ``weight_version``.

        ``load`` must write in place (``param.copy_(...)`` under ``torch.no_grad()``), not
        replace tensors: CUDA graphs keep reading the same storage, and CPU weight packing
        repacks a weight whose version counter moved. Refused with ``RuntimeError`` while a
        request is unfinished (queued, running, or kept by ``suspend``); allowed while
        suspended. If ``load`` raises, the prefix cache is dropped all the same, the version
        stays and the error propagates."""
        with self._lock:
            if self.has_unfinished_requests():
                raise RuntimeError("update_weights: the engine has unfinished requests; finish or abort them")
            try:
                load(self.model)
            finally:
                self.context.allocator.reset()
            self._weight_version += 1
            return self._weight_version

    @property
    def weight_version(self) -> int:
        """How many times ``update_weights`` loaded new weights (0 for those it was built with)."""
        return self._weight_version

    # ----------------------------------------------------------------- suspend, resume, shutdown
    def suspend(self) -> int:
        """Free the KV cache, keeping every unfinished request (it is recomputed after ``resume``);
        return the bytes freed. Steps do nothing while suspended."""
        with self._lock:
            if self._suspended:
                return 0
            while self._incoming:
                self.scheduler.add(self._incoming.popleft())
            for request in self.scheduler.requeue_all():
                request.add_event(RequestEventType.PAUSE)
            self._suspended = True
            if self.graph_runner is not None:
                self.graph_runner.reset()
            return self.context.deallocate()

    def resume(self) -> None:
        """Reallocate the KV cache; suspended requests continue in their original order."""
        with self._lock:
            if self._suspended:
                self.context.allocate()
                self._suspended = False

    def cache_stats(self) -> dict[str, float]:
        """``kv_cache_usage``: the share of KV-cache blocks that requests hold (0 while
        suspended); ``prefix_cache_hit_tokens`` / ``prefix_cache_query_tokens``: prompt tokens
        served from the prefix cache / looked up in it, so far."""
        allocator = self.context.allocator
        usage = 0.0 if self._suspended else 1.0 - allocator.num_free_blocks / allocator.num_blocks
        return {
            "kv_cache_usage": usage,
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": self.scheduler.prefix_cache_query_tokens,
        }

    @property
    def suspended(self) -> bool:
        """Whether ``suspend`` freed the cache and ``resume`` was not called since."""
        return self._suspended

    def shutdown(self) -> None:
        """Refuse new requests and fail every unfinished one, which wakes its waiters and streams."""
        self._shutdown = True
        self._fail_unfinished("EngineShutdownError: the engine was shut down")
