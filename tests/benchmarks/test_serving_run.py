"""``benchmarks/serving.py`` run end to end on a tiny random Llama: mcore-serve alone, and with
``vllm serve`` too where vLLM's CPU venv exists. Oracle: the requests the script's seeded workload
asks for (their count, prompt and output tokens), and the figures' own definitions."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from llama_workload import SETUP_HINT, find_vllm_python, save_model, workload

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow  # each server imports torch (vLLM also compiles) and serves the load

# head_dim 64: vLLM's CPU attention takes only its usual head sizes
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=512,
)
SEED, PROMPTS = 1, 2  # outputs of 37 and 44 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serving") / "tiny-llama"
    save_model(directory, TINY)
    return directory


def _run(model_dir: Path, log_dir: Path, *options: str, timeout: float) -> dict:
    command = [sys.executable, str(BENCHMARKS / "serving.py"), "--model-dir", str(model_dir)]
    command += ["--log-dir", str(log_dir)]
    command += ["--num-prompts", str(PROMPTS), "--seed", str(SEED), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_figures(figures: dict, most_in_flight: int, seed: int = SEED) -> None:
    requests = workload(PROMPTS, seed, TINY["vocab_size"])
    assert (figures["completed"], figures["failed"]) == (PROMPTS, 0)
    assert figures["output_tokens"] == sum(n for _, n in requests)  # ignore_eos: exactly max_tokens
    assert figures["prompt_tokens"] == sum(len(p) for p, _ in requests)
    assert figures["request_throughput"] == pytest.approx(PROMPTS / figures["duration_s"])
    assert figures["output_throughput"] == pytest.approx(figures["output_tokens"] / figures["duration_s"])
    assert figures["max_in_flight"] == most_in_flight
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < figures[f"median_{name}_ms"] <= figures[f"p99_{name}_ms"]
    assert figures["median_ttft_ms"] < figures["median_e2el_ms"] <= 1e3 * figures["duration_s"]
    assert figures["front_end_cpu_s_per_1k_tokens"] > 0 and figures["engines_cpu_s_per_1k_tokens"] > 0


@pytest.mark.timeout(600)  # a loaded 2-core machine takes a minute or more to start mcore-serve
def test_mcore_serve_alone_with_bounded_concurrency_over_two_rounds(model_dir, tmp_path):
    results = _run(model_dir, tmp_path, "--no-vllm", "--max-concurrency", "1", "--rounds", "2", timeout=560)
    assert results["model"] == TINY and results["max_concurrency"] == 1 and results["rounds"] == 2
    first, second = results["mcore"]["rounds"]
    assert (first["seed"], second["seed"]) == (SEED, SEED + 1)  # new prompts: no prefix cache carries over
    _check_figures(first, most_in_flight=1, seed=SEED)
    _check_figures(second, most_in_flight=1, seed=SEED + 1)
    assert "idle_peer_cpu_s" not in first  # no other server was up
    for key in ("output_throughput", "p99_ttft_ms", "engines_cpu_s_per_1k_tokens"):
        assert results["mcore"][key] == pytest.approx((first[key] + second[key]) / 2)  # median of two
    assert results["vllm"] is None and results["mcore_over_vllm"] is None
    assert results["vllm_skipped"] == "--no-vllm"


@pytest.mark.timeout(1500)
def test_mcore_serve_and_vllm_serve_side_by_side(model_dir, tmp_path):
    if find_vllm_python(None) is None:
        pytest.skip(f"vLLM's CPU venv is absent (the peer runs from it): {SETUP_HINT}")
    results = _run(model_dir, tmp_path, timeout=1400)
    assert (tmp_path / "vllm-serve.log").stat().st_size > 0
    _check_figures(results["mcore"], most_in_flight=PROMPTS)
    _check_figures(results["vllm"], most_in_flight=PROMPTS)
    assert results["mcore"]["idle_peer_cpu_s"] >= 0 and results["vllm"]["idle_peer_cpu_s"] >= 0  # both up
    ratios = results["mcore_over_vllm"]
    for key in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_itl_ms"):
        assert ratios[key] == pytest.approx(results["mcore"][key] / results["vllm"][key])
    assert results["vllm"]["settings"]["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_session_cpu_seconds_splits_the_leader_from_its_session():
    """A session whose leader waits while its child burns 0.5 s of CPU (then waits too): the
    child's time counts as the engines', the leader's as the front end's."""
    from serving_servers import session_cpu_seconds

    child = "import sys, time\nwhile time.process_time() < 0.5: pass\nprint('burnt', flush=True)\nsys.stdin.read()"
    leader = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])"
    process = subprocess.Popen(
        [sys.executable, "-c", leader], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert process.stdout.readline() == b"burnt\n"
        used = session_cpu_seconds(process.pid)
    finally:
        process.communicate(b"", timeout=60)
    assert used["engines"] >= 0.45 > used["front_end"]  # /proc counts whole clock ticks
    assert session_cpu_seconds(process.pid) is None  # gone
