"""pass@k against hand-computed values of the unbiased estimator, and ``evaluate`` over a scripted
handle whose correct samples are known: mean reward, pass@k per prompt averaged, failed rewards."""

import math

import pytest
from mcore_rl.agents import AdditionAgent, AdditionExample, evaluate, pass_at_k
from mcore_rl.inference import Generation, SamplingOptions


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),  # 1 - C(3,1)/C(5,1)
        (5, 2, 2, 7 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 9 / 10),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # fewer than 4 wrong ones: any 4 hold a right one
        (5, 0, 3, 0.0),
        (4, 4, 1, 1.0),
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match=r"c: must be in \[0, n=3\], got 4"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match=r"k: must be in \[1, n=3\], got 0"):
        pass_at_k(3, 1, 0)
    with pytest.raises(TypeError, match="n: must be an int"):
        pass_at_k(3.0, 1, 1)


class RightFirst:
    """A handle answering prompt ``i`` right on its first ``right[i]`` samples, else with "0"."""

    def __init__(self, right):
        self.right = right

    def generate(self, prompts, **sampling):
        options = SamplingOptions(**sampling)
        out = []
        for i, prompt in enumerate(prompts):
            a, b = map(int, prompt[:-1].split("+"))
            for j in range(options.n):
                text = f"{a + b}\n" if j < self.right[i] else "0\n"
                out.append(Generation([1], [ord(c) for c in text], text, [0.0] * len(text), "stop", i, j))
        return out


class PartialCredit(AdditionAgent):
    """Addition with partial credit whose reward raises for the sum 9."""

    def get_reward(self, example, completion_text):
        if example.a + example.b == 9:
            raise ZeroDivisionError("nine")
        return super().get_reward(example, completion_text)


def test_evaluate_reports_mean_reward_and_pass_at_k():
    agent = AdditionAgent(10, 2, seed=0)
    result = evaluate(agent, RightFirst([2, 1]), n=4, ks=(1, 2, 4), temperature=1.0)
    assert (result.num_prompts, result.num_samples, result.num_failed) == (2, 4, 0)
    assert result.mean_reward == 3 / 8
    assert result.pass_at_k == pytest.approx(
        {1: (2 / 4 + 1 / 4) / 2, 2: ((1 - 1 / 6) + (1 - 3 / 6)) / 2, 4: 1.0}
    )


def test_evaluate_counts_failed_rewards_as_incorrect_and_leaves_them_out_of_the_mean():
    agent = PartialCredit(10, 2, partial_credit=True)
    examples = [AdditionExample(4, 5), AdditionExample(12, 30)]  # 9 raises; 42 vs "0": 0.0
    result = evaluate(agent, RightFirst([4, 1]), n=2, examples=examples)
    assert result.num_failed == 2
    assert result.mean_reward == 0.5  # 1.0 and 0.0 for the second prompt
    assert result.pass_at_k == {1: (0 + 1 / 2) / 2}
    all_failed = evaluate(agent, RightFirst([1]), n=1, examples=[AdditionExample(4, 5)])
    assert math.isnan(all_failed.mean_reward) and all_failed.pass_at_k == {1: 0.0}


def test_evaluate_refuses_bad_arguments():
    agent = AdditionAgent(10, 2)
    with pytest.raises(ValueError, match=r"ks: every k must be an int in \[1, n=2\], got 3"):
        evaluate(agent, RightFirst([1, 1]), n=2, ks=(1, 3))
    with pytest.raises(ValueError, match="has no evaluation prompts"):
        evaluate(AdditionAgent(10, 0), RightFirst([]), n=1)
