"""The embedded default's ``CharTokenizer``: one id per character, the end token 0 read as a
newline (so ``AdditionAgent`` stops reading the answer there), bad text and ids named."""

import pytest
from mcore_rl.agents import AdditionAgent, AdditionExample
from mcore_rl.loop import CharTokenizer


def test_round_trip_and_end_token():
    tokenizer = CharTokenizer()
    assert tokenizer.vocab_size == len(tokenizer) == 13 and tokenizer.eod_id == tokenizer.pad_id == 0
    assert tokenizer.encode("12+34=") == [2, 3, 11, 4, 5, 12]
    assert tokenizer.decode([*tokenizer.encode("46"), 0, 7]) == "46\n6"
    reward = AdditionAgent(10, 2).get_reward(AdditionExample(12, 34), tokenizer.decode([5, 7, 0, 2]))
    assert reward == 1.0  # "46" then the end token: the answer is read up to it


def test_bad_text_ids_and_alphabets_are_named():
    tokenizer = CharTokenizer()
    with pytest.raises(ValueError, match=r"'x' is not in the tokenizer's alphabet"):
        tokenizer.encode("1x")
    with pytest.raises(ValueError, match=r"ids: 13 is outside the vocabulary \[0, 13\)"):
        tokenizer.decode([1, 13])
    with pytest.raises(ValueError, match="alphabet: must be distinct characters"):
        CharTokenizer("11")
