"""The embedded default corpus: the source files of the running interpreter's standard library.

Every Python installation carries ~10 MB of real, varied Python code, so a model can be trained
and evaluated without downloading anything. One document per ``*.py`` file under
``sysconfig.get_paths()["stdlib"]``; ``site-packages`` is skipped, and so are files that do not
decode as UTF-8. Test suites (any folder named ``test``, ``tests`` or ``idle_test``) are left out
by default: they double the size with repetitive code, and ``include_tests=True`` brings them back.

The held-out split is by file and deterministic: a file is held out when the SHA-256 of its
relative path, read as a fraction of 2**64, is below ``heldout_fraction``. The same file lands in
the same split on every machine and for every fraction that contains it.
"""

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mcore_api import internal_api

TEST_FOLDERS = frozenset({"test", "tests", "idle_test"})
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Document:
    """One source file: ``name`` is its path relative to the stdlib root, ``text`` its content."""

    name: str
    text: str


def stdlib_root() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    """Whether the file at ``relative_path`` (POSIX form) belongs to the held-out split."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def stdlib_documents(
    split: str = "train",
    heldout_fraction: float = 0.05,
    include_tests: bool = False,
    root: Path | None = None,
) -> Iterator[Document]:
    """The documents of ``split`` (``"train"`` or ``"heldout"``), sorted by relative path.

    ``root`` replaces the stdlib folder (for tests). Files that are not valid UTF-8 are skipped.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    root = stdlib_root() if root is None else Path(root)
    want_heldout = split == "heldout"
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts:
            continue
        if not include_tests and TEST_FOLDERS.intersection(relative.parts[:-1]):
            continue
        name = relative.as_posix()
        if is_heldout(name, heldout_fraction) != want_heldout:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        yield Document(name=name, text=text)


@internal_api
def corpus_fingerprint(documents: Iterator[Document]) -> str:
    """A short hex digest of the documents' names and contents, in order."""
    digest = hashlib.sha256()
    for document in documents:
        for part in (document.name, document.text):
            encoded = part.encode()
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
    return digest.hexdigest()[:16]
