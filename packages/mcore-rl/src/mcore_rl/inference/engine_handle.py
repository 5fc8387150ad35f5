"""An inference handle over an in-process ``mcore_inference.DynamicInferenceEngine``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mcore_api import experimental_api
from mcore_inference import DynamicInferenceEngine, RequestStatus

from .errors import GenerationError
from .generation import Generation, Prompt
from .prompts import prompt_token_ids
from .sampling import SamplingOptions, finish_reason
from .vocab import check_vocabulary


@experimental_api
class EngineHandle:
    """``generate`` through a local ``DynamicInferenceEngine``: all prompts and samples are added
    at once and batched by the engine. Text (prompts, completions, stop strings) goes through
    the engine's ``tokenizer`` (e.g. ``load_checkpoint_for_inference(path).tokenizer``); without
    one, prompts must be token ids, ``stop`` is refused and ``Generation.text`` is ``None``.

    The engine's tokenizer is checked against the model's vocabulary when the handle is built
    (``VocabularyMismatchError``). A prompt the engine fails (an id outside the vocabulary, a
    sequence longer than its context, ...) raises ``GenerationError`` naming the prompt's index
    and the engine's reason, after the whole batch ran."""

    def __init__(self, engine: DynamicInferenceEngine):
        if not isinstance(engine, DynamicInferenceEngine):
            raise TypeError(f"engine: must be a DynamicInferenceEngine, got {type(engine).__name__}")
        if engine.tokenizer is not None:
            check_vocabulary(engine.tokenizer, engine.vocab_size, "the engine's model")
        self.engine = engine

    @property
    def tokenizer(self) -> Any | None:
        """The engine's tokenizer, or ``None``."""
        return self.engine.tokenizer

    def generate(self, prompts: Sequence[Prompt], **sampling: Any) -> list[Generation]:
        """``n`` completions of each prompt (``sampling``: the fields of ``SamplingOptions``)."""
        options = SamplingOptions(**sampling)
        if options.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need an engine with a tokenizer")
        ids = prompt_token_ids(prompts, self.tokenizer)
        keys = [(i, j) for i in range(len(ids)) for j in range(options.n)]
        requests = self.engine.generate(
            [ids[i] for i, _ in keys], [options.engine_params(j, i) for i, j in keys]
        )
        failed = [
            (i, r.error) for (i, _), r in zip(keys, requests, strict=True) if r.status is RequestStatus.FAILED
        ]
        if failed:
            raise GenerationError(f"the engine failed prompt {failed[0][0]}: {failed[0][1]}")
        return [self._generation(ids[i], i, j, r) for (i, j), r in zip(keys, requests, strict=True)]

    def _generation(self, prompt: list[int], index: int, sample: int, request: Any) -> Generation:
        tokens = list(request.generated_tokens)
        text = request.generated_text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(tokens)
        return Generation(
            prompt_ids=prompt,
            completion_ids=tokens,
            text=text,
            logprobs=[float(x) for x in request.generated_logprobs],
            finish_reason=finish_reason(request.finish_reason),
            prompt_index=index,
            sample_index=sample,
        )
