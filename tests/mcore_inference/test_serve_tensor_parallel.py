"""``mcore-serve --tensor-parallel-size 2`` as a subprocess over loopback: each engine is two
processes splitting the tiny Hugging Face Llama of ``serve_process``; the unmodified ``openai``
client gets the greedy completions of the same checkpoint's in-process TP = 1 engine (oracle), whole
and streamed, from two such engines and from a single one; a killed rank takes its engine down (the
server then reports no live engine); a tensor-parallel size that does not split the heads is
refused naming the option, before any engine starts. (Each server start costs tens of seconds on a
2-core machine: the single-engine server is the one whose rank the kill test kills.)"""

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from mcore_parallel import find_free_port
from mcore_testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import (
    KV_CACHE_BYTES,
    in_process_greedy,
    start_serve,
    stop_serve,
    write_tiny_hf_model,
)

pytestmark = pytest.mark.slow  # each mcore-serve imports torch and starts engine processes

PROMPTS = [[ord(c) for c in "def fib(n):"], [ord(c) for c in "import os\n"]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("serve-tp") / "tiny-llama")


@pytest.fixture(scope="module")
def expected(model_dir):
    """The in-process TP = 1 engine's greedy texts of ``PROMPTS``."""
    (results,) = run_distributed(
        in_process_greedy, 1, model_dir, PROMPTS, MAX_TOKENS, init_process_group=False
    )
    assert all(0 not in tokens for tokens, _ in results)  # the text comparisons cover every token
    return [text for _, text in results]


def _serve_args(model_dir, dp=1):
    return [
        str(model_dir),
        *("--tensor-parallel-size", "2", "--data-parallel-size", str(dp)),
        *("--kv-cache-memory", str(KV_CACHE_BYTES)),
    ]


def _greedy(client, prompt, **options):
    return client.completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **options,
    )


def _assert_completes_and_streams_like_one_process(port, expected, engines):
    """Every one of ``engines`` (round robin) answers ``PROMPTS`` as the oracle does, and a
    streamed completion adds up to the oracle's text."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    for _ in range(engines):  # round robin: every engine answers, and answers the same
        completion = _greedy(client, PROMPTS)  # two prompts: one batch over the engine's ranks
        assert [c.text for c in sorted(completion.choices, key=lambda c: c.index)] == expected
    chunks = [chunk.choices[0].text for chunk in _greedy(client, PROMPTS[1], stream=True) if chunk.choices]
    assert "".join(chunks) == expected[1] and len(chunks) > 1


def test_tensor_parallel_engines_complete_and_stream_like_one_process(model_dir, expected, tmp_path):
    """Two data-parallel engines of two ranks each (the single-engine case: the kill test)."""
    port = find_free_port()
    process = start_serve(_serve_args(model_dir, dp=2), tmp_path, port)
    try:
        _assert_completes_and_streams_like_one_process(port, expected, engines=2)
    finally:
        returncode, output = stop_serve(process)
    assert returncode == 0, output
    assert "engines ready 2/2" in output and "tensor-parallel size 2" in output
    assert "mcore-serve: stopped" in output


def _engine_ranks(parent: int) -> list[int]:
    """The spawned processes of ``parent`` (its engine ranks, not the resource tracker), oldest first."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (ValueError, OSError, IndexError):
            continue
        if ppid == parent and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def test_a_killed_rank_takes_its_engine_down(model_dir, expected, tmp_path):
    """One engine of two ranks: it serves like one process until a rank is killed."""
    port = find_free_port()
    process = start_serve(_serve_args(model_dir), tmp_path, port)
    try:
        _assert_completes_and_streams_like_one_process(port, expected, engines=1)
        ranks = _engine_ranks(process.pid)
        assert len(ranks) == 2
        os.kill(ranks[-1], signal.SIGKILL)  # a follower, not the rank the coordinator knows
        deadline, status = time.monotonic() + 30, 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
        assert status == 503  # the coordinator lost the engine: no live engine
        assert not any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in ranks)
    finally:
        returncode, output = stop_serve(process)
    assert returncode == 0, output
    assert "engines ready 1/1" in output and "tensor-parallel size 2" in output
    assert "mcore-serve-engine0-tp1 died (exit code -9); stopping its engine" in output


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "size, field",
    [("3", "num_attention_heads"), ("8", "num_attention_heads")],
    ids=["not-dividing-the-heads", "more-ranks-than-heads"],
)
def test_a_tensor_parallel_size_that_does_not_split_the_model_is_refused(model_dir, refused, size, field):
    status, stdout, stderr = refused([str(model_dir), "--tensor-parallel-size", size])
    assert status == 2
    assert f"tensor_parallel_size: {size} ranks cannot split the model of" in stderr
    assert field in stderr
    assert "starting" not in stdout  # refused before any engine process
