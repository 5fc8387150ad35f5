"""Batch-shape buckets for CUDA graphs: building the list and matching real batches."""

import itertools

import pytest
from mcore_inference import InferenceBatchDimensions as Dims
from mcore_inference import build_batch_buckets, match_bucket


def test_bucket_list():
    buckets = build_batch_buckets(max_requests=8, max_tokens=64, max_prefill_requests=2)
    decode_only = [b for b in buckets if b.prefill_req_count == 0]
    assert decode_only == [Dims(n, 0, n) for n in (1, 2, 4, 8)]
    mixed = [b for b in buckets if b.prefill_req_count]
    assert mixed == [Dims(16, 2, 6), Dims(32, 2, 6), Dims(64, 2, 6)]
    assert buckets == sorted(buckets)
    with pytest.raises(ValueError, match="max_prefill_requests"):
        build_batch_buckets(4, 64, max_prefill_requests=5)
    with pytest.raises(ValueError, match="token_count 1 is below"):
        Dims(1, 1, 1)


def test_every_real_batch_gets_the_smallest_fitting_bucket():
    buckets = build_batch_buckets(max_requests=8, max_tokens=64, max_prefill_requests=2)
    for prefill, decode in itertools.product(range(3), range(7)):
        for tokens in range(prefill * 2 + decode, 65, 5):  # prefill chunks are >= 2 tokens
            if prefill == 0:
                tokens = decode
            if tokens == 0:
                continue
            batch = Dims(tokens, prefill, decode)
            bucket = match_bucket(batch, buckets)
            assert bucket is not None and bucket.fits(batch)
            smaller = [
                b
                for b in buckets
                if b.fits(batch) and (b.token_count, b.req_count) < (bucket.token_count, bucket.req_count)
            ]
            assert not smaller
    assert match_bucket(Dims(5, 0, 5), buckets) == Dims(8, 0, 8)
    assert match_bucket(Dims(20, 1, 3), buckets) == Dims(32, 2, 6)
    assert match_bucket(Dims(70, 1, 3), buckets) is None  # over max_tokens: eager
    assert match_bucket(Dims(10, 3, 0), buckets) is None  # too many prefills


def test_dimensions_of_a_step():
    assert Dims.of_step([1, 1, 7, 1, 3]) == Dims(13, 2, 3)
