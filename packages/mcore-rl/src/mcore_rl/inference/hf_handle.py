"""An inference handle over a plain Hugging Face causal language model, for tests and tiny runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from mcore_api import experimental_api
from mcore_inference import SamplingParams, sample

from .errors import GenerationError
from .generation import Generation, Prompt
from .prompts import prompt_token_ids
from .sampling import SamplingOptions
from .vocab import check_vocabulary


@experimental_api
class HFHandle:
    """``generate`` with a Hugging Face ``*ForCausalLM`` model (e.g. built by
    ``transformers.AutoModelForCausalLM.from_pretrained``; mcore-rl itself never imports
    transformers) in eval mode, decoding the ``n`` samples of each prompt as one batch with the
    model's KV cache.

    Tokens are drawn by ``mcore_inference.sample`` from the last position's logits (in float32),
    exactly as the mcore engine draws them: temperature, top-k, top-p, and for a seeded sample
    the same uniform number at the same step, so a seeded handle reproduces the engine's samples
    on the same weights. ``Generation.logprobs`` are those of the model's distribution at that
    step, before temperature and filters.

    ``tokenizer`` (``encode``/``decode``; optional: without it prompts are token ids and ``text`` is
    ``None``) is checked against the model's embedding rows (``VocabularyMismatchError``).
    ``eos_token_ids`` end a completion (default: the model's ``generation_config.eos_token_id``)."""

    def __init__(
        self, model: Any, tokenizer: Any | None = None, *, eos_token_ids: int | Sequence[int] | None = None
    ):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "get_input_embeddings"):
            raise TypeError(
                f"model: must be a Hugging Face causal LM (torch.nn.Module), got {type(model).__name__}"
            )
        if model.training:
            raise ValueError("model: is in training mode; call model.eval() first")
        self.vocab_size = model.get_input_embeddings().num_embeddings
        if tokenizer is not None:
            check_vocabulary(tokenizer, self.vocab_size, f"the model ({type(model).__name__})")
        if eos_token_ids is None:
            eos_token_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = (
            []
            if eos_token_ids is None
            else [eos_token_ids]
            if isinstance(eos_token_ids, int)
            else eos_token_ids
        )
        self.eos_token_ids = frozenset(int(t) for t in ids)
        self.model, self.tokenizer = model, tokenizer

    def generate(self, prompts: Sequence[Prompt], **sampling: Any) -> list[Generation]:
        """``n`` completions of each prompt (``sampling``: the fields of ``SamplingOptions``)."""
        options = SamplingOptions(**sampling)
        if options.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a handle with a tokenizer")
        ids = prompt_token_ids(prompts, self.tokenizer)
        too_large = [(i, t) for i, p in enumerate(ids) for t in p if t >= self.vocab_size]
        if too_large:
            raise GenerationError(
                f"prompt {too_large[0][0]}: token id {too_large[0][1]} >= vocabulary {self.vocab_size}"
            )
        return [g for index, prompt in enumerate(ids) for g in self._sample_group(prompt, index, options)]

    @torch.no_grad()
    def _sample_group(self, prompt: list[int], index: int, options: SamplingOptions) -> list[Generation]:
        """The ``n`` samples of one prompt, decoded together (no padding: same prompt)."""
        params = [options.engine_params(j, index) for j in range(options.n)]
        device = next(self.model.parameters()).device
        inputs = torch.tensor([prompt] * options.n, device=device)
        tokens: list[list[int]] = [[] for _ in params]
        logprobs: list[list[float]] = [[] for _ in params]
        reasons: list[str | None] = [None] * options.n
        texts: list[str | None] = [None] * options.n
        cache = None
        for _ in range(options.max_tokens):
            output = self.model(input_ids=inputs, past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            drawn = sample(output.logits[:, -1].float(), params, output_tokens=tokens)
            for row, param in enumerate(params):
                if reasons[row] is None:
                    self._take(drawn.tokens[row], drawn.logprobs[row], index, tokens[row], logprobs[row])
                    reasons[row], texts[row] = self._stop(tokens[row], param)
            if all(reasons):
                break
            inputs = torch.tensor([[row[-1]] for row in tokens], device=device)
        return [
            Generation(prompt, tokens[j], texts[j], logprobs[j], reasons[j] or "length", index, j)
            for j in range(options.n)
        ]

    @staticmethod
    def _take(token: int, logprob: float, index: int, tokens: list[int], logprobs: list[float]) -> None:
        if token < 0:
            raise GenerationError(
                f"prompt {index}: the model's logits have no valid distribution (NaN or inf)"
            )
        tokens.append(token)
        logprobs.append(logprob)

    def _stop(self, tokens: list[int], params: SamplingParams) -> tuple[str | None, str | None]:
        """``(finish reason or None, text)`` of a row that just took a token (``mcore_inference``'s
        rules: end-of-sequence unless ignored, then stop strings, then length)."""
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else None
        if not params.ignore_eos and tokens[-1] in self.eos_token_ids:
            return "stop", text
        cuts = [text.find(s) for s in params.stop_strings if s in text] if text is not None else []
        if cuts:
            return "stop", text[: min(cuts)]
        return ("length" if len(tokens) >= params.num_tokens_to_generate else None), text
