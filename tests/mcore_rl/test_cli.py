"""``mcore-rl``: ``--help`` lists the config dataclasses' options; a tiny run writes a parseable
``report.json`` and ``reward.png``, and ``--load`` resumes it; bad values exit with the field named."""

import contextlib
import io
import json
import struct

import pytest
from mcore_rl.cli import main

TINY = [
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "64",
    "--num-train", "100", "--num-test", "10", "--sft-steps", "5", "--prompts-per-iteration", "4",
    "--group-size", "4", "--max-tokens", "4", "--eval-interval", "1", "--no-progress",
]  # fmt: skip


def test_help_lists_the_config_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in (
        "--max-digits",
        "--hidden-size",
        "--sft-steps",
        "--group-size",
        "--beta",
        "--load",
        "--output-dir",
    ):
        assert option in text
    assert "AdditionTaskConfig" in text and "GRPOLoopConfig" in text


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _run(argv):
    return main(argv)


def _exit(argv):
    """``main``'s exit code and what it wrote to stderr."""
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            main(argv)
        except SystemExit as error:
            return error.code, errors.getvalue()
    return 0, errors.getvalue()


def test_a_tiny_run_writes_its_report_and_plot_and_resumes(run_distributed, tmp_path):
    output = tmp_path / "out"
    argv = [*TINY, "--iterations", "2", "--output-dir", str(output)]
    assert run_distributed(_run, 1, argv, init_process_group=False, timeout=120) == [0]
    report = json.loads((output / "report.json").read_text())
    assert report["iterations"] == 2 and [r["iteration"] for r in report["history"]] == [1, 2]
    for key in ("heldout_before", "heldout_after"):
        assert set(report[key]) >= {"reward", "accuracy"} and 0.0 <= report[key]["accuracy"] <= 1.0
    assert report["heldout_after"]["reward"] == report["history"][-1]["heldout_reward"]
    assert set(report["timings"]) == {"generation", "reference", "training", "refit"}
    assert len(report["warmup_losses"]) == 5
    assert png_size(output / "reward.png") == (960, 600)
    resumed = tmp_path / "resumed"
    argv = [*TINY, "--iterations", "3", "--output-dir", str(resumed), "--load", str(output / "checkpoint")]
    assert run_distributed(_run, 1, argv, init_process_group=False, timeout=120) == [0]
    history = json.loads((resumed / "report.json").read_text())["history"]
    assert [r["iteration"] for r in history] == [1, 2, 3] and history[:2] == report["history"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--group-size", "1"], "group_size: must be >= 2, got 1"),
        (["--min-digits", "3", "--max-digits", "2"], "min_digits, max_digits: need min_digits <= max_digits"),
        (["--load", "/nonexistent/ckpt"], "/nonexistent/ckpt/rl_state.pt: no RL checkpoint there"),
        (
            ["--bin-length", "64", "--max-sequence-length", "65"],
            "max_sequence_length, bin_length: a sequence must fit in a bin",
        ),
    ],
)
def test_bad_values_exit_naming_the_field(run_distributed, tmp_path, argv, message):
    argv = [*TINY, "--output-dir", str(tmp_path), *argv]
    ((code, stderr),) = run_distributed(_exit, 1, argv, init_process_group=False, timeout=120)
    assert code == 2 and message in stderr
