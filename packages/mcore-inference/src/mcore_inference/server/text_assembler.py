"""Incremental detokenization of one output, cut at the first stop string."""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import ServingTokenizer

_REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of an unfinished UTF-8 character


class TextAssembler:
    """Turns an output's tokens, as they come, into text that is safe to send: text that ends in
    an unfinished UTF-8 character, or in the start of a stop string, is held back until the next
    tokens settle it. Once a stop string appears, ``stopped`` is set and the text ends before it
    (the stop string itself is never sent, as in the OpenAI API).

    Each ``add`` decodes only a short window of the latest tokens (those since the text last
    ended on a whole character, with the tokens before them as context for decoders that look
    back, e.g. SentencePiece's leading space), so a long output costs linear, not quadratic, time."""

    def __init__(self, tokenizer: ServingTokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.tokens: list[int] = []
        self.text = ""  # the whole output's text so far (cut at the stop string once stopped)
        self.stopped = False
        self._sent = 0  # characters of ``text`` handed out
        self._settled = ""  # the text of tokens[:_read], which ends on a whole character
        self._context = self._read = 0  # the window decoded next starts at tokens[_context]
        self._context_text = ""  # the text of tokens[_context:_read]

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new tokens; return the text they make safe to send (maybe empty)."""
        if self.stopped:
            return ""
        self.tokens.extend(token_ids)
        unsettled = self._decode_new()
        self.text = self._settled + unsettled
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._take(cut)
        safe = len(self.text.rstrip(_REPLACEMENT))
        safe -= self._held_for_stop(self.text[:safe])
        return self._take(safe)

    def _decode_new(self) -> str:
        """The text of tokens[_read:], settling it when it ends on a whole character."""
        window = self.tokenizer.decode(self.tokens[self._context :])
        new = window[len(self._context_text) :] if window.startswith(self._context_text) else None
        if new is None:  # the context decodes differently now: fall back to the whole output
            new = self.tokenizer.decode(self.tokens)[len(self._settled) :]
        if new and not new.endswith(_REPLACEMENT):
            self._settled += new
            self._context, self._read = self._read, len(self.tokens)
            self._context_text = self.tokenizer.decode(self.tokens[self._context : self._read])
            return ""
        return new

    def finish(self) -> str:
        """The text still held back, once the output has ended."""
        return self._take(len(self.text))

    def kept_tokens(self) -> int:
        """How many of the tokens make up ``text`` (after a stop: those up to the one that
        completed the text before the stop string)."""
        if not self.stopped:
            return len(self.tokens)
        for count in range(len(self.tokens) + 1):
            if len(self.tokenizer.decode(self.tokens[:count])) >= len(self.text):
                return count
        return len(self.tokens)

    def _take(self, end: int) -> str:
        piece = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece

    def _first_stop(self) -> int | None:
        cuts = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(cuts) if cuts else None

    def _held_for_stop(self, text: str) -> int:
        """Length of the longest end of ``text`` that starts some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
