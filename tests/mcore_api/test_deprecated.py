"""deprecated(): one warning per call site, naming version, removal version and alternative."""

import asyncio
import inspect
import warnings

import pytest
from mcore_api import deprecated


def _collect(action):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
    return [w for w in caught if issubclass(w.category, DeprecationWarning)]


@deprecated("0.2.0", removal_version="0.4.0", alternative="mcore_fsdp.fully_shard")
def old_shard(module: str, *, mesh: int = 1) -> str:
    """Shard the old way."""
    return f"{module}@{mesh}"


def test_message_names_version_removal_and_alternative():
    caught = _collect(lambda: old_shard("m"))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message == (
        f"{__name__}.old_shard is deprecated since version 0.2.0; it will be removed in version 0.4.0; "
        "use mcore_fsdp.fully_shard instead."
    )


def test_warning_points_at_the_caller():
    caught = _collect(lambda: old_shard("m"))
    assert caught[0].filename == __file__


def test_one_warning_per_call_site():
    def call_three_times_from_one_line():
        for _ in range(3):
            old_shard("m")

    def call_from_two_lines():
        old_shard("a")
        old_shard("b")

    assert len(_collect(call_three_times_from_one_line)) == 1
    assert len(_collect(call_three_times_from_one_line)) == 0  # that site has warned already
    assert len(_collect(call_from_two_lines)) == 2


def test_function_keeps_signature_docstring_and_result():
    assert str(inspect.signature(old_shard)) == "(module: str, *, mesh: int = 1) -> str"
    assert old_shard.__doc__ == "Shard the old way."
    assert old_shard.__name__ == "old_shard"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert old_shard("m", mesh=4) == "m@4"
    assert old_shard.__mcore_api_stability__ == "deprecated"
    assert old_shard.__mcore_api_deprecated__.removal_version == "0.4.0"


def test_classes_warn_on_instantiation_and_keep_their_signature():
    @deprecated("0.3.0")
    class OldBuffer:
        """A buffer."""

        def __init__(self, size: int, dtype: str = "fp32"):
            self.size = size

    assert str(inspect.signature(OldBuffer)) == "(size: int, dtype: str = 'fp32')"
    assert OldBuffer.__doc__ == "A buffer."
    caught = _collect(lambda: OldBuffer(4))
    assert len(caught) == 1
    assert "OldBuffer is deprecated since version 0.3.0; it may be removed in a future version." in str(
        caught[0].message
    )
    with pytest.warns(DeprecationWarning):
        assert isinstance(OldBuffer(2), OldBuffer)


def test_class_without_its_own_init_keeps_an_empty_signature():
    @deprecated("0.3.0")
    class Empty:
        pass

    assert str(inspect.signature(Empty)) == "()"
    assert len(_collect(Empty)) == 1


def test_methods_static_and_class_methods():
    class Holder:
        @deprecated("0.2.0", alternative="Holder.new")
        def old(self, x: int) -> int:
            return x + 1

        @deprecated("0.2.0")
        @staticmethod
        def old_static(x: int) -> int:
            return x * 2

        @deprecated("0.2.0")
        @classmethod
        def old_class(cls) -> str:
            return cls.__name__

    holder = Holder()
    assert str(inspect.signature(Holder.old)) == "(self, x: int) -> int"
    caught = _collect(lambda: (holder.old(1), Holder.old_static(2), Holder.old_class()))
    assert [str(w.message).split(" is ")[0].rsplit(".", 2)[-2:] for w in caught] == [
        ["Holder", "old"],
        ["Holder", "old_static"],
        ["Holder", "old_class"],
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (holder.old(1), Holder.old_static(2), Holder.old_class()) == (2, 4, "Holder")


def test_coroutine_functions_stay_coroutine_functions():
    @deprecated("0.2.0")
    async def fetch(x: int) -> int:
        return x

    assert inspect.iscoroutinefunction(fetch)
    caught = _collect(lambda: asyncio.run(fetch(3)))
    assert len(caught) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"version": "soon"}, ValueError, "version must be a version string"),
        ({"version": "0.2.0", "removal_version": "0.1.0"}, ValueError, "must be later than"),
        ({"version": "0.2.0", "removal_version": "0.2.0"}, ValueError, "must be later than"),
        ({"version": "0.2.0", "alternative": 3}, TypeError, "alternative must be a string"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        deprecated(**kwargs)


def test_bare_decorator_use_is_rejected():
    with pytest.raises(TypeError, match=r"write @deprecated\('0.2.0'\)"):

        @deprecated
        def f():
            pass
