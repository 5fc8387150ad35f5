"""Does GRPO raise the held-out reward of ``mcore-rl``'s embedded default, on several seeds?

For each seed, the default run (``mcore_rl.loop.run_default``: supervised warm-up on the
``"warmup"`` sums, then GRPO on other sums) with ``GRPOLoopConfig.seed`` (prompt order, warm-up
batches, rollout sampling) and ``PolicyConfig.model_seed`` (initial weights) both set from it; the
task's splits stay the same. Prints per seed the held-out reward (sampled as in training) and the
greedy accuracy before and after GRPO, their gains, the wall time, and whether every seed's
held-out reward rose. Options are those of ``mcore-rl`` for the iterations and the evaluation.

    uv run python benchmarks/rl_default_seeds.py [--seeds 0 1 2] [--iterations 60]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from mcore_rl.loop import RLConfigs, run_default


def run_seed(seed: int, iterations: int, output_dir: str) -> dict[str, float]:
    """The default run at ``seed``: held-out results before and after, and its seconds."""
    configs = RLConfigs()
    configs.grpo.seed, configs.grpo.iterations = seed, iterations
    configs.grpo.eval_interval = iterations
    configs.policy.model_seed = 1234 + seed
    configs.run.output_dir, configs.run.progress = output_dir, False
    began = time.perf_counter()
    report = run_default(configs)
    before, after = report["heldout_before"], report["heldout_after"]
    return {
        "seed": seed,
        "reward_before": before["reward"],
        "reward_after": after["reward"],
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "seconds": time.perf_counter() - began,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=RLConfigs().grpo.iterations)
    args = parser.parse_args()
    rows = []
    print(
        f"{'seed':>4}  {'reward before':>13}  {'after':>6}  {'gain':>7}  {'greedy acc before':>17}  {'after':>6}  {'seconds':>7}"
    )
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as output:
            row = run_seed(seed, args.iterations, output)
        rows.append(row)
        print(
            f"{seed:>4}  {row['reward_before']:>13.3f}  {row['reward_after']:>6.3f}  "
            f"{row['reward_after'] - row['reward_before']:>+7.3f}  {row['accuracy_before']:>17.3f}  "
            f"{row['accuracy_after']:>6.3f}  {row['seconds']:>7.1f}",
            flush=True,
        )
    rose = all(r["reward_after"] > r["reward_before"] for r in rows)
    print(
        f"held-out reward rose on {sum(r['reward_after'] > r['reward_before'] for r in rows)} of {len(rows)} seeds"
    )
    print(json.dumps({"iterations": args.iterations, "all_rose": rose, "seeds": rows}))


if __name__ == "__main__":
    main()
