"""mcore_parallel's public surface: which names carry a stability marker, and that every name is
documented in its docstring and in the package README."""

from mcore_testing.public_api import missing_from_readme, stability_markers, undocumented

PUBLIC_MODULES = ["mcore_parallel", "mcore_parallel.parallel_state"]

# Changing this is an API decision: internal names may leave __all__ in a later release,
# experimental ones may change in any release.
MARKED = {
    "GradBucket": "internal",
    "ParamAndGradBuffer": "internal",
    "ephemeral_port_range": "internal",
    "flag_of": "internal",
    "sharded_parameter": "internal",
    "vocab_range": "internal",
    "BridgeCommunicator": "experimental",
    "MultiModuleProcessGroups": "experimental",
    "PipelineAction": "experimental",
    "schedule_actions": "experimental",
    "GradientCheck": "experimental",
    "check_gradient": "experimental",
    "expected_error_bound": "experimental",
    "relative_difference": "experimental",
    "sharded_frobenius_norm": "experimental",
}


def test_stability_markers():
    assert stability_markers("mcore_parallel") == MARKED
    assert stability_markers("mcore_parallel.parallel_state") == {}


def test_every_public_name_has_a_docstring():
    assert [name for module in PUBLIC_MODULES for name in undocumented(module)] == []


def test_every_public_name_is_in_the_readme():
    assert missing_from_readme(PUBLIC_MODULES, "mcore-parallel") == []
