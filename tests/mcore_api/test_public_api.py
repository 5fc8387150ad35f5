"""mcore_api's public surface: no stability markers, every name documented in the package README."""

from mcore_testing.public_api import missing_from_readme, stability_markers, undocumented


def test_public_surface_is_documented_and_unmarked():
    assert stability_markers("mcore_api") == {}
    assert undocumented("mcore_api") == []
    assert missing_from_readme(["mcore_api"], "mcore-api") == []
