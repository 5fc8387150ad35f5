"""The ``mcore-serve`` command, run as a subprocess over loopback: a tiny Hugging Face model
directory, found with no MODEL_DIR where ``mcore-train`` writes by default, served by 2
data-parallel engine processes, queried with the unmodified ``openai`` client (oracle: the same
checkpoint's in-process engine, greedy, same prompt tokens), stopped by SIGTERM; and the ways it
refuses to start."""

import shutil
import socket
import sys
import time
from pathlib import Path

import openai
import pytest
from mcore_parallel import find_free_port

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import (
    KV_CACHE_BYTES,
    in_process_greedy,
    run_serve,
    start_serve,
    start_serve_until,
    stop_serve,
    write_tiny_hf_model,
)

pytestmark = pytest.mark.slow  # each mcore-serve imports torch and starts engine processes

PROMPT = [ord(c) for c in "def fib(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("serve") / "tiny-llama")


def test_two_engines_serve_mcore_trains_default_output_and_sigterm_stops_them(
    model_dir, run_distributed, tmp_path
):
    """With no MODEL_DIR: ``mcore-train``'s default output, named after its run directory (one
    server start for both: the other tests here and in ``test_serve_*`` pass a MODEL_DIR)."""
    (((tokens, text),),) = run_distributed(
        in_process_greedy, 1, model_dir, [PROMPT], MAX_TOKENS, init_process_group=False
    )
    assert 0 not in tokens  # the text comparison below covers every token
    shutil.copytree(model_dir, tmp_path / "mcore-train-output" / "checkpoints")
    port = find_free_port()
    args = ["--data-parallel-size", "2", "--api-key", "k", "--kv-cache-memory", str(KV_CACHE_BYTES)]
    process = start_serve(args, tmp_path, port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["checkpoints"]
        for _ in range(2):  # round robin: both engines answer, and answer the same
            completion = client.completions.create(
                model="checkpoints",
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert completion.choices[0].text == text
            assert completion.usage.completion_tokens == MAX_TOKENS
    finally:
        started = time.monotonic()
        returncode, output = stop_serve(process)
    assert returncode == 0, output
    assert time.monotonic() - started < 30
    assert "mcore-train-output/checkpoints" in output
    assert "engines ready 2/2" in output and "mcore-serve: stopped" in output
    with socket.socket() as probe:  # nothing listens on the port any more (closed connections may linger)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))


def test_sigterm_while_the_engines_load_stops_everything(model_dir, tmp_path):
    port = find_free_port()
    args = [str(model_dir), "--data-parallel-size", "2", "--kv-cache-memory", str(KV_CACHE_BYTES)]
    process, before = start_serve_until(args, tmp_path, port, "starting 2 engine processes")
    started = time.monotonic()
    returncode, output = stop_serve(process)
    assert returncode == 0, before + output
    assert "interrupted during start-up; stopped" in output
    assert time.monotonic() - started < 30


def test_no_argument_without_default_output_says_how_to_get_one(refused):
    status, _, stderr = refused([])
    assert status == 1
    assert "no ./mcore-train-output/checkpoints" in stderr
    assert "uv run mcore-train" in stderr


def test_a_directory_that_is_not_a_checkpoint_is_refused(refused, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    status, _, stderr = refused([str(tmp_path)])
    assert status == 1
    assert "is neither an mcore-train checkpoint" in stderr
    assert "Traceback" not in stderr


def test_a_port_in_use_is_refused(model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve([str(model_dir), "--port", str(port)], tmp_path)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_a_max_model_len_beyond_the_models_positions_is_refused(model_dir, refused):
    status, _, stderr = refused([str(model_dir), "--max-model-len", "1000"])
    assert status == 1
    assert "--max-model-len 1000 exceeds the model's maximum position 256" in stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "70000"], "port: must be in 1..65535"),
        (["--data-parallel-size", "0"], "data_parallel_size: must be >= 1"),
        (["--dtype", "int8"], "invalid choice: 'int8'"),
        (["--engine-heartbeat-timeout", "0"], "engine_heartbeat_timeout: must be >= 0.1"),
        (["--no-engine-wait", "-1"], "no_engine_wait: must be >= 0"),
    ],
)
def test_bad_options_are_refused_naming_the_field(model_dir, refused, args, message):
    status, _, stderr = refused([str(model_dir), *args])
    assert status == 2
    assert message in stderr
