"""``mcore-preprocess``: tokenize jsonl or text files into an indexed dataset.

    mcore-preprocess --input data/*.jsonl --output-prefix out/train --tokenizer tokenizer.json

``.jsonl`` files give one document per line (the ``--json-key`` field, default ``text``); other
files give one document each, or one per line with ``--text-unit line``. Each document is
encoded (in ``--workers`` processes), followed by the EOD id unless ``--no-eod``, and written as
one sequence of ``<prefix>.bin``/``<prefix>.idx``. Without ``--tokenizer`` the BPE trained on the
standard library (``default_tokenizer``) is used.
"""

import argparse
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mcore_models.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from mcore_models.data.tokenizer import Tokenizer, default_tokenizer

TEXT_UNITS = ("file", "line")
_JSONL_SUFFIXES = (".jsonl", ".json")
_worker_tokenizer: Tokenizer | None = None


def read_documents(
    paths: Iterable[str | os.PathLike], json_key: str = "text", text_unit: str = "file"
) -> Iterator[str]:
    """The document texts of ``paths``, in order (see the module docstring)."""
    if text_unit not in TEXT_UNITS:
        raise ValueError(f"text_unit must be one of {TEXT_UNITS}, got {text_unit!r}")
    for path in map(Path, paths):
        if path.suffix in _JSONL_SUFFIXES:
            yield from _read_jsonl(path, json_key)
        elif text_unit == "line":
            with open(path, encoding="utf-8") as lines:
                yield from (line.rstrip("\n") for line in lines if line.strip())
        else:
            yield path.read_text(encoding="utf-8")


def write_indexed_dataset(
    texts: Iterable[str],
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    append_eod: bool = True,
    workers: int = 1,
    progress: bool = True,
) -> IndexedDataset:
    """Encode ``texts`` with ``tokenizer`` in ``workers`` processes and write one sequence per
    text (plus the EOD id) to ``<output_prefix>.bin``/``.idx``, in order; returns the dataset."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size) as writer:
        with _encoder(tokenizer, workers) as encode:
            for ids in tqdm(
                encode(texts),
                desc=f"tokenizing {Path(output_prefix).name}",
                unit=" docs",
                disable=not progress,
            ):
                writer.add_document(np.append(ids, tokenizer.eod_id) if append_eod else ids)
    return IndexedDataset(output_prefix)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``mcore-preprocess``."""
    args = _parser().parse_args(argv)
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_file(args.tokenizer, eod_token=args.eod_token)
    else:
        tokenizer = default_tokenizer(vocab_size=args.vocab_size)
    started = time.perf_counter()
    dataset = write_indexed_dataset(
        read_documents(args.input, args.json_key, args.text_unit),
        args.output_prefix,
        tokenizer,
        append_eod=not args.no_eod,
        workers=args.workers,
    )
    print(
        f"wrote {dataset.num_documents} documents, {dataset.num_tokens} tokens ({dataset.dtype}) "
        f"to {args.output_prefix}.bin/.idx in {time.perf_counter() - started:.1f} s"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-preprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="jsonl or text files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: the BPE trained on the stdlib)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the default tokenizer")
    parser.add_argument("--eod-token", help="name of the end-of-document token of --tokenizer")
    parser.add_argument("--json-key", default="text", help="field of a jsonl record that holds the text")
    parser.add_argument(
        "--text-unit", choices=TEXT_UNITS, default="file", help="a document per file or per line"
    )
    parser.add_argument("--no-eod", action="store_true", help="do not append the EOD id to each document")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    return parser


def _read_jsonl(path: Path, json_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                raise ValueError(f"{path}:{number}: no string field {json_key!r} (set --json-key)")
            yield record[json_key]


@contextmanager
def _encoder(tokenizer: Tokenizer, workers: int) -> Iterator[Callable[[Iterable[str]], Iterator[np.ndarray]]]:
    """``encode(texts) -> id arrays``, in order, through a pool of ``workers`` processes (in this
    process when ``workers == 1``)."""
    if workers == 1:
        yield lambda texts: (_token_array(tokenizer, text) for text in texts)
        return
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    )
    with context.Pool(workers, _start_worker, (tokenizer,)) as pool:
        yield lambda texts: pool.imap(_encode_in_worker, texts, chunksize=16)


def _token_array(tokenizer: Tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _start_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_in_worker(text: str) -> np.ndarray:
    return _token_array(_worker_tokenizer, text)
