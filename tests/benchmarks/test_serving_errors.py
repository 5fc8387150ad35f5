"""How ``benchmarks/serving.py`` refuses what it cannot run: bad options, a model too short for
the requests, a missing vLLM python, a server that does not start; each a message naming it."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serving
from llama_workload import save_model

SHORT = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=128,
)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--num-prompts", "-3"], "--num-prompts must be >= 1"),
    ],
)
def test_bad_options_exit_2_naming_the_option(options, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serving.main(options)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_named_vllm_python_that_is_missing_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="does not exist; create it with"):
        serving.main(["--vllm-python", str(tmp_path / "python")])


def test_a_model_too_short_for_the_requests_is_refused_before_any_server(tmp_path):
    save_model(tmp_path, SHORT)
    with pytest.raises(SystemExit, match=r"max_position_embeddings is 128; serve a model with at least \d+"):
        serving.main(["--model-dir", str(tmp_path), "--no-vllm", "--num-prompts", "4"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_that_exits_while_starting_is_named_with_its_output(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SHORT, "max_position_embeddings": 512}))
    with pytest.raises(SystemExit, match=r"mcore-serve exited with code 1 while starting"):
        serving.main(
            ["--model-dir", str(tmp_path), "--no-vllm", "--num-prompts", "1", "--log-dir", str(tmp_path)]
        )
