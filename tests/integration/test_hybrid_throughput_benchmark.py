"""``benchmarks/hybrid_throughput.py --quick`` runs end to end: its mcore ``HybridModel`` computes
the logits HF's ``NemotronHForCausalLM`` computes (the script refuses to time it otherwise), and its
JSON line holds positive training figures for both and mcore's ratio against HF, and generated
tokens/s of mcore's engine serving the imported model and of HF ``generate`` on the same requests,
with the ratio. Figures are not judged: this machine may be shared."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronHConfig"):
    pytest.skip("this transformers has no NemotronH", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_throughput.py"


@pytest.mark.slow
def test_quick_run_prints_every_figure():
    command = [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--requests", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "logits check" in run.stdout
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "hybrid_throughput" and result["quick"] is True
    training = result["training"]
    assert set("M*-E") <= set(training["shape"]["pattern"])
    assert training["mcore_parameters"] == training["hf_parameters"] > 0
    for name in ("mcore", "hf"):
        assert training[f"{name}_tokens_per_s"] > 0 and training[f"{name}_step_ms"] > 0
    assert training["mcore_over_hf"] > 0
    inference = result["inference"]
    assert inference["requests"] == 2 and inference["generated_tokens"] > 0 and inference["mcore_steps"] > 0
    for name in ("mcore", "hf"):
        assert inference[f"{name}_tokens_per_s"] > 0
    assert inference["mcore_over_hf"] == pytest.approx(
        inference["mcore_tokens_per_s"] / inference["hf_tokens_per_s"]
    )
    for row in ("training (fwd+bwd+AdamW)", "inference (bf16, greedy)", "mcore-inference", "HF generate"):
        assert row in run.stdout
