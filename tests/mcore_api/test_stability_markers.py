"""internal_api and experimental_api label objects and leave them otherwise untouched."""

import inspect

import pytest
from mcore_api import experimental_api, internal_api


def _sample(a: int, b: str = "x", *, c: float = 1.0) -> str:
    """Sample docstring."""
    return f"{a}{b}{c}"


@pytest.mark.parametrize(
    ("marker", "label"), [(internal_api, "internal"), (experimental_api, "experimental")]
)
def test_functions_keep_identity_signature_and_docstring(marker, label):
    signature = inspect.signature(_sample)
    marked = marker(_sample)
    assert marked is _sample
    assert inspect.signature(marked) == signature
    assert marked.__doc__ == "Sample docstring."
    assert marked(1, c=2.0) == "1x2.0"
    assert marked.__mcore_api_stability__ == label


def test_classes_and_methods_are_marked():
    @experimental_api
    class Planner:
        """Plans."""

        def __init__(self, depth: int = 2):
            self.depth = depth

        @internal_api
        def step(self, n: int) -> int:
            return n + self.depth

        @internal_api
        @staticmethod
        def helper(x: int) -> int:
            return 2 * x

    assert Planner.__mcore_api_stability__ == "experimental"
    assert Planner.step.__mcore_api_stability__ == "internal"
    assert Planner.helper.__mcore_api_stability__ == "internal"
    assert str(inspect.signature(Planner)) == "(depth: int = 2)"
    assert Planner.__doc__ == "Plans."
    assert Planner(3).step(1) == 4
    assert Planner.helper(5) == 10


def test_non_callables_are_rejected():
    with pytest.raises(TypeError, match="functions, methods and classes"):
        internal_api(42)
