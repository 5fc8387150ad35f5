"""mcore_models' public surface: which names carry a stability marker, and that every name is
documented in its docstring and in the package README."""

from mcore_testing.public_api import missing_from_readme, stability_markers, undocumented

PUBLIC_MODULES = [
    "mcore_models",
    "mcore_models.data",
    "mcore_models.training",
    "mcore_models.transformer.moe",
]

# Changing these is an API decision: internal names may leave __all__ in a later release,
# experimental ones may change in any release.
MARKED_MODELS = {
    "gather_full_tensor": "experimental",
    "shard_full_tensor": "experimental",
    "state_tensors": "experimental",
    "context_parallel_attention": "experimental",
    "context_parallel_positions": "experimental",
    "gather_sequence": "experimental",
    "restore_sequence_order": "experimental",
    "split_batch": "experimental",
    "split_sequence": "experimental",
}
MARKED_DATA = {
    "GPTIndices": "internal",
    "build_gpt_indices": "internal",
    "blend_order": "internal",
    "corpus_fingerprint": "internal",
    "token_dtype": "internal",
}
MARKED_TRAINING = {
    "TrainData": "internal",
    "open_train_data": "internal",
    "open_indexed_data": "internal",
    "iteration_micro_batches": "internal",
    "resolve_configs": "internal",
    "run_in_process_group": "internal",
    "under_torchrun": "internal",
    "training_state_dict": "internal",
    "TrainModel": "experimental",
    "build_train_model": "experimental",
    "LocalOptimizer": "experimental",
    "build_optimizer": "experimental",
    "evaluate": "experimental",
    "logit_kl_loss": "experimental",
    "hidden_state_loss": "experimental",
    "greedy_generate": "experimental",
    "save_training_checkpoint": "experimental",
    "load_training_checkpoint": "experimental",
    "launch_local": "experimental",
    "Trainer": "experimental",
}

# Everything of the MoE module but the two protocols, which cannot carry the marker attribute.
MARKED_MOE = {
    name: "experimental"
    for name in (
        "AllGatherTokenDispatcher",
        "AllToAllTokenDispatcher",
        "GroupedExperts",
        "MoELayer",
        "MoESubmodules",
        "RouterOutput",
        "RouterReplay",
        "RouterReplayAction",
        "SequentialExperts",
        "SharedExpertMLP",
        "TopKRouter",
        "attach_router_replay",
        "aux_loss_backward_scale",
        "group_limited_topk",
        "reset_global_loads",
        "router_loss_metrics",
        "set_router_replay_action",
        "update_expert_biases",
    )
}


def test_stability_markers():
    assert stability_markers("mcore_models") == MARKED_MODELS
    assert stability_markers("mcore_models.data") == MARKED_DATA
    assert stability_markers("mcore_models.training") == MARKED_TRAINING
    assert stability_markers("mcore_models.transformer.moe") == MARKED_MOE


def test_every_public_name_has_a_docstring():
    assert [name for module in PUBLIC_MODULES for name in undocumented(module)] == []


def test_every_public_name_is_in_the_readme():
    assert missing_from_readme(PUBLIC_MODULES, "mcore-models") == []
