"""The addition task: rewards of hand-written completions, deterministic and disjoint splits,
operands of the asked digit counts, and its refusals."""

import pytest
from mcore_rl.agents import AdditionAgent, AdditionExample


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("357", 1.0),
        ("357\n", 1.0),
        (" 357<|endoftext|>", 1.0),
        ("357 and more", 1.0),
        ("3570", 0.0),
        ("358", 0.0),
        ("", 0.0),
        ("\n357", 0.0),
        ("-357", 0.0),
        ("٣٥٧", 0.0),  # Arabic-Indic digits are not the answer
    ],
)
def test_reward_is_one_for_the_exact_sum_before_a_terminator(text, reward):
    agent = AdditionAgent(10, 10)
    assert agent.get_reward(AdditionExample(12, 345), text) == reward


@pytest.mark.parametrize(
    ("text", "reward"),
    [("357", 1.0), ("358", 0.5 * 2 / 3), ("3570", 0.0), ("57", 0.5 * 2 / 3), ("x", 0.0), ("999", 0.0)],
)
def test_partial_credit_is_half_the_share_of_right_aligned_matching_digits(text, reward):
    agent = AdditionAgent(10, 10, partial_credit=True)
    assert agent.get_reward(AdditionExample(12, 345), text) == pytest.approx(reward)


def test_splits_are_deterministic_disjoint_and_sized():
    agent = AdditionAgent(300, 50, min_digits=2, max_digits=3, seed=4)
    train, test = agent.get_dataset("train"), agent.get_dataset("test")
    assert len(train) == 300 and len(test) == 50
    assert len(set(train)) == 300 and not set(train) & set(test)
    assert all(10 <= x < 1000 for e in [*train, *test] for x in (e.a, e.b))
    assert {len(str(e.a)) for e in train} == {2, 3}  # both digit counts drawn
    again = AdditionAgent(300, 50, min_digits=2, max_digits=3, seed=4)
    assert again.get_dataset("train") == train and again.evaluation_prompts() == test
    assert AdditionAgent(300, 50, min_digits=2, max_digits=3, seed=5).get_dataset("train") != train
    assert agent.get_dataset("warmup") == []
    with_warmup = AdditionAgent(300, 50, num_warmup=80, min_digits=2, max_digits=3, seed=4)
    warmup = with_warmup.get_dataset("warmup")
    assert len(set(warmup)) == 80 and not set(warmup) & (set(train) | set(test))
    assert with_warmup.get_dataset("train") == train and with_warmup.get_dataset("test") == test
    example = train[0]
    assert agent.get_prompt(example) == f"{example.a}+{example.b}=" and example.answer == str(
        example.a + example.b
    )


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="split: must be one of"):
        AdditionAgent(10, 10).get_dataset("validation")
    with pytest.raises(ValueError, match="num_train: must be an int >= 0"):
        AdditionAgent(-1)
    with pytest.raises(ValueError, match=r"max_digits: must be an int in \[min_digits=3, 18\]"):
        AdditionAgent(10, 10, min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="only 100; ask for at most half"):
        AdditionAgent(40, 20, min_digits=1, max_digits=1)
    with pytest.raises(ValueError, match="num_train \\+ num_test \\+ num_warmup: 60 distinct sums asked"):
        AdditionAgent(20, 20, num_warmup=20, min_digits=1, max_digits=1)
    with pytest.raises(ValueError, match="num_warmup: must be an int >= 0"):
        AdditionAgent(10, 10, num_warmup=-1)
