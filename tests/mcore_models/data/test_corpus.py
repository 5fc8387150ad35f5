"""The stdlib corpus: which files become documents and which split they land in."""

import pytest
from mcore_models.data.corpus import Document, corpus_fingerprint, is_heldout, stdlib_documents


@pytest.fixture
def fake_stdlib(tmp_path):
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": "# json\n",
        "test/test_os.py": "def test(): pass\n",
        "unittest/tests/test_case.py": "x = 1\n",
        "site-packages/pkg/mod.py": "y = 2\n",
        "notes.txt": "not python\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    return tmp_path


def _names(root, **kwargs):
    return [document.name for document in stdlib_documents(root=root, heldout_fraction=0.0, **kwargs)]


def test_documents_skip_site_packages_non_utf8_and_tests(fake_stdlib):
    assert _names(fake_stdlib) == ["json/__init__.py", "os.py"]
    assert _names(fake_stdlib, include_tests=True) == [
        "json/__init__.py",
        "os.py",
        "test/test_os.py",
        "unittest/tests/test_case.py",
    ]
    assert next(stdlib_documents(root=fake_stdlib)) == Document("json/__init__.py", "# json\n")


def test_heldout_split_is_by_path_hash_and_partitions_the_files(fake_stdlib):
    names = set(_names(fake_stdlib, include_tests=True))
    for fraction in (0.0, 0.3, 0.7, 1.0):
        kwargs = dict(root=fake_stdlib, heldout_fraction=fraction, include_tests=True)
        train = {d.name for d in stdlib_documents("train", **kwargs)}
        heldout = {d.name for d in stdlib_documents("heldout", **kwargs)}
        assert train | heldout == names and not train & heldout
        assert heldout == {name for name in names if is_heldout(name, fraction)}
    assert not any(is_heldout(name, 0.0) for name in names)
    assert all(is_heldout(name, 1.0) for name in names)


def test_real_stdlib_heldout_share_is_near_the_fraction():
    names = [document.name for document in stdlib_documents(heldout_fraction=0.0)]
    assert len(names) > 300 and "os.py" in names
    share = sum(is_heldout(name, 0.1) for name in names) / len(names)
    assert 0.06 < share < 0.14


def test_bad_arguments_are_rejected(fake_stdlib):
    with pytest.raises(ValueError, match="split"):
        next(stdlib_documents("validation", root=fake_stdlib))
    with pytest.raises(ValueError, match="heldout_fraction"):
        next(stdlib_documents(heldout_fraction=1.5, root=fake_stdlib))


def test_fingerprint_changes_with_content_and_name():
    base = [Document("a.py", "x"), Document("b.py", "y")]
    assert corpus_fingerprint(iter(base)) == corpus_fingerprint(iter(list(base)))
    assert corpus_fingerprint(iter(base)) != corpus_fingerprint(
        iter([Document("a.py", "x"), Document("b.py", "z")])
    )
    assert corpus_fingerprint(iter(base)) != corpus_fingerprint(
        iter([Document("a.pyx", ""), Document("b.py", "y")])
    )
