"""mcore_rl's public surface: every name but ``__version__`` marked ``experimental_api`` (its
signatures may change while the rest of the RL stack is built), documented, and in the README."""

import mcore_rl
import mcore_rl.loop
from mcore_testing.public_api import missing_from_readme, stability_markers, undocumented

# Changing this is an API decision: unmarked names are held to backward compatibility.
EXPERIMENTAL = {
    "AdditionAgent",
    "AdditionExample",
    "ContrastivePair",
    "EndpointUnavailableError",
    "EngineBusyError",
    "EngineHandle",
    "EvaluationResult",
    "GRPOLoss",
    "GRPOLossConfig",
    "Generation",
    "GenerationError",
    "GroupAdvantages",
    "HFHandle",
    "InferenceHandle",
    "OpenAIHandle",
    "PackedBatch",
    "PackedBin",
    "RefitError",
    "RefitMismatchError",
    "RewardOnlyAgent",
    "Rollout",
    "RolloutGroup",
    "SamplingOptions",
    "TaskExample",
    "TaskMixture",
    "TrainingSequence",
    "VocabularyMismatchError",
    "check_vocabulary",
    "contrastive_pairs",
    "evaluate",
    "group_advantages",
    "grouped_rollouts",
    "grpo_loss",
    "kl_estimate",
    "label_logprobs",
    "pack_sequences",
    "packed_grpo_loss",
    "pass_at_k",
    "refit",
    "single_rollouts",
    "unpack_completions",
}


LOOP = {
    "AdditionTaskConfig",
    "CharTokenizer",
    "CheckpointError",
    "GRPOLoop",
    "GRPOLoopConfig",
    "PolicyConfig",
    "RLConfigs",
    "RunConfig",
    "WarmupConfig",
    "load_checkpoint",
    "run_default",
    "save_checkpoint",
    "supervised_warmup",
}


def test_loop_surface_is_experimental_and_documented():
    assert set(mcore_rl.loop.__all__) == LOOP
    assert stability_markers("mcore_rl.loop") == dict.fromkeys(LOOP, "experimental")
    assert undocumented("mcore_rl.loop") == []
    assert missing_from_readme(["mcore_rl.loop"], "mcore-rl") == []


def test_public_surface_is_experimental_and_documented():
    assert set(mcore_rl.__all__) == EXPERIMENTAL | {"__version__"}
    assert stability_markers("mcore_rl") == dict.fromkeys(EXPERIMENTAL, "experimental")
    assert undocumented("mcore_rl") == []
    assert missing_from_readme(["mcore_rl"], "mcore-rl") == []
