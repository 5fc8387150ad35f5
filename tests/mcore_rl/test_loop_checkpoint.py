"""Checkpoint and resume of the whole RL state: a loop resumed after iteration 2 (from a policy
with other initial weights) runs iteration 3 exactly as the uninterrupted loop does: the same
rollouts, rewards, loss, weights, Adam state, reference and prompt position; with the optimizer
state offloaded (on a CPU-only machine the offloaded state is the parameters' own: nothing
moves, the option's plumbing and resume are what is checked) and two optimizer steps per
iteration. Missing or mismatched checkpoints are refused with ``CheckpointError`` naming the path."""

import sys
from pathlib import Path

import pytest
import torch
from mcore_rl.loop import CheckpointError, load_checkpoint, save_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import build_loop

SAME = ("train_reward", "trained_sequences", "trained_tokens", "loss", "grad_norm", "kl", "weight_version")


OPTIONS = dict(beta=0.05, optimizer_cpu_offload=True, minibatches=2)


def _resume(directory):
    uninterrupted = build_loop(seed=0, **OPTIONS)
    uninterrupted.step()
    uninterrupted.step()
    save_checkpoint(uninterrupted, directory)
    expected = uninterrupted.step()
    resumed = build_loop(seed=7, **OPTIONS)  # other initial weights: everything must come from the file
    start = load_checkpoint(resumed, directory)
    got = resumed.step()
    weights = all(
        torch.equal(a, b)
        for a, b in zip(uninterrupted.policy.parameters(), resumed.policy.parameters(), strict=True)
    )
    return dict(
        start=start,
        expected={k: expected[k] for k in SAME},
        got={k: got[k] for k in SAME},
        weights=weights,
        position=(uninterrupted.prompts.position, resumed.prompts.position),
        history=(len(uninterrupted.history), len(resumed.history)),
        offloaded=resumed.optimizer.offloaded_numel == sum(p.numel() for p in resumed.policy.parameters()),
        steps=(expected["optimizer_steps"], resumed.optimizer.step_count),
    )


def test_resume_gives_the_same_next_iteration(run_distributed, tmp_path):
    (result,) = run_distributed(_resume, 1, str(tmp_path / "ckpt"), timeout=180)
    assert result["start"] == 2
    assert result["got"]["weight_version"] == 2  # one refit at load, one after the step
    expected, got = result["expected"], result["got"]
    for key in SAME[:-1]:
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7), key
    assert result["weights"] and result["offloaded"]
    assert result["steps"] == (2, 6)
    assert result["position"][0] == result["position"][1] == 3 * 4
    assert result["history"] == (3, 3)


def _refused(directory):
    errors = []
    for build, path in (
        (lambda: build_loop(), directory + "/missing"),
        (lambda: build_loop(beta=0.1), directory),
    ):
        loop = build()
        try:
            load_checkpoint(loop, path)
        except CheckpointError as error:
            errors.append(str(error))
    return errors


def _save(directory):
    save_checkpoint(build_loop(), directory)


def test_missing_or_mismatched_checkpoints_are_refused(run_distributed, tmp_path):
    run_distributed(_save, 1, str(tmp_path), timeout=120)
    missing, mismatched = run_distributed(_refused, 1, str(tmp_path), timeout=120)[0]
    assert "missing/rl_state.pt: no RL checkpoint there" in missing
    assert "beta" in mismatched and "without a reference policy" in mismatched
