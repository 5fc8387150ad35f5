"""``benchmarks/moe_throughput.py --quick`` runs end to end: its mcore MoE blocks compute what HF's
Mixtral and Qwen3-MoE blocks compute (the script refuses to time them otherwise), and its JSON line
holds a positive figure and a ratio for every contender (HF's loop-over-experts blocks where
transformers can switch to them), and the engine's and HF ``generate``'s
inference figures. Figures are not judged: this machine may be shared."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mcore_inference")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_throughput.py"


@pytest.mark.slow
def test_quick_run_prints_every_figure():
    command = [sys.executable, str(SCRIPT), "--quick", "--no-vllm", "--threads", "1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    training, inference = result["training"], result["inference"]
    contenders = [
        f"{impl}_{family}{experts}_{level}"
        for family in ("mixtral", "qwen3_moe")
        for impl, experts in (("hf", ""), ("mcore", "_sequential"), ("mcore", "_grouped"))
        for level in ("block", "model")
    ]
    import transformers

    if hasattr(transformers.PreTrainedModel, "set_experts_implementation"):  # HF's loop block too
        contenders += [f"hf_{family}_loop_block" for family in ("mixtral", "qwen3_moe")]
        loops = [f"mcore_{family}_sequential_block" for family in ("mixtral", "qwen3_moe")]
        assert all(training[f"{name}_over_hf_loop"] > 0 for name in loops)
    assert sorted(k.removesuffix("_tokens_per_s") for k in training if k.endswith("_tokens_per_s")) == sorted(
        contenders
    )
    assert all(training[f"{name}_tokens_per_s"] > 0 for name in contenders)
    assert all(training[f"{name}_over_hf"] > 0 for name in contenders if name.startswith("mcore"))
    assert inference["mcore_tokens_per_s"] > 0 and inference["hf_tokens_per_s"] > 0
    assert inference["vllm_tokens_per_s"] is None and inference["vllm_skipped"] == "--no-vllm"
    assert "training (fwd+bwd+AdamW)" in run.stdout
