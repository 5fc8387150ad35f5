"""mcore-fsdp declares exactly the distributions its code imports: every requirement is used, and
every import outside the standard library is declared (an optional one under an extra)."""

import mcore_fsdp
from mcore_testing.dependencies import declared_distributions, imported_distributions


def test_declared_dependencies_are_the_imported_ones():
    always, optional = declared_distributions("mcore-fsdp")
    imported = imported_distributions(mcore_fsdp)
    assert always <= imported, f"declared, never imported: {sorted(always - imported)}"
    assert imported <= always | optional, f"imported, not declared: {sorted(imported - always - optional)}"


def test_requires_only_torch():
    # What lets it install alone into any trainer.
    always, _ = declared_distributions("mcore-fsdp")
    assert always == {"torch"}
