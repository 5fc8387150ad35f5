"""A synthetic, verifiable task: multi-digit addition ("12+345=" -> "357")."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from mcore_api import experimental_api

from .agent import RewardOnlyAgent

SPLITS = ("train", "test", "warmup")


@experimental_api
@dataclass(frozen=True)
class AdditionExample:
    """One sum ``a + b``; ``prompt`` is ``"a+b="`` and ``answer`` the decimal sum."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        """``"a+b="``."""
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        """The sum in decimal digits."""
        return str(self.a + self.b)


@experimental_api
class AdditionAgent(RewardOnlyAgent):
    """Multi-digit addition: ``num_train``, ``num_test`` and ``num_warmup`` distinct sums (the
    ``"train"``, ``"test"`` and ``"warmup"`` splits: no pair ``(a, b)`` in two of them; the
    warm-up split is for supervised training before RL, so that RL's prompts are sums the
    policy was not taught), each operand drawn with a digit count uniform in ``[min_digits, max_digits]``,
    then a number of that many digits uniformly; the same ``seed`` gives the same splits.

    The reward reads the completion's leading digits (after leading spaces) up to the first
    character that is not a digit (a terminator: newline, space, end-of-sequence text, ...) or
    the end: 1.0 when they are exactly the sum. Otherwise 0.0, or with ``partial_credit`` half the
    share of digit positions, aligned from the right over the longer of the two numbers, that
    match (below 0.5, so only an exact answer reaches 1)."""

    name = "addition"

    def __init__(
        self,
        num_train: int = 2000,
        num_test: int = 200,
        *,
        num_warmup: int = 0,
        min_digits: int = 1,
        max_digits: int = 3,
        seed: int = 0,
        partial_credit: bool = False,
    ):
        for field, value, low in (
            ("num_train", num_train, 0),
            ("num_test", num_test, 0),
            ("num_warmup", num_warmup, 0),
            ("min_digits", min_digits, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{field}: must be an int >= {low}, got {value!r}")
        if (
            isinstance(max_digits, bool)
            or not isinstance(max_digits, int)
            or not min_digits <= max_digits <= 18
        ):
            raise ValueError(
                f"max_digits: must be an int in [min_digits={min_digits}, 18], got {max_digits!r}"
            )
        numbers = 10**max_digits - (10 ** (min_digits - 1) if min_digits > 1 else 0)
        total = num_train + num_test + num_warmup
        if total > numbers**2 // 2:
            raise ValueError(
                f"num_train + num_test + num_warmup: {total} distinct sums asked, but operands of "
                f"{min_digits}-{max_digits} digits give only {numbers**2}; ask for at most half of them"
            )
        self.min_digits, self.max_digits, self.partial_credit = min_digits, max_digits, partial_credit
        pairs = self._distinct_pairs(total, random.Random(seed))
        test_end = num_train + num_test
        self._splits = {
            "train": pairs[:num_train],
            "test": pairs[num_train:test_end],
            "warmup": pairs[test_end:],
        }

    def _distinct_pairs(self, count: int, rng: random.Random) -> list[AdditionExample]:
        seen: dict[AdditionExample, None] = {}
        while len(seen) < count:
            seen.setdefault(AdditionExample(self._operand(rng), self._operand(rng)))
        return list(seen)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)

    def get_dataset(self, split: str) -> Sequence[AdditionExample]:
        """The examples of ``"train"``, ``"test"`` or ``"warmup"`` (``ValueError`` for another split)."""
        if split not in self._splits:
            raise ValueError(f"split: must be one of {SPLITS}, got {split!r}")
        return self._splits[split]

    def get_prompt(self, example: AdditionExample) -> str:
        """``"a+b="``."""
        return example.prompt

    def get_reward(self, example: AdditionExample, completion_text: str) -> float:
        """1.0 for the exact sum before a terminator; else 0.0 or the partial credit."""
        text = completion_text.lstrip(" ")
        end = next((i for i, ch in enumerate(text) if not ch.isdigit() or not ch.isascii()), len(text))
        given, answer = text[:end], example.answer
        if given == answer:
            return 1.0
        if not self.partial_credit or not given:
            return 0.0
        width = max(len(given), len(answer))
        same = sum(g == a for g, a in zip(given[::-1], answer[::-1], strict=False))
        return 0.5 * same / width
