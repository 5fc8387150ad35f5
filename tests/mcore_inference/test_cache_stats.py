"""``DynamicInferenceEngine.cache_stats``: the share of KV-cache blocks held by requests and the
prefix cache's hit and looked-up prompt tokens, counted by hand."""

from mcore_inference import SamplingParams


def test_cache_stats_count_blocks_and_prefix_hits(make_model, make_engine):
    engine = make_engine(make_model(), blocks=64, block_size=4)
    zero = {"kv_cache_usage": 0.0, "prefix_cache_hit_tokens": 0, "prefix_cache_query_tokens": 0}
    assert engine.cache_stats() == zero
    prompt = list(range(1, 11))
    params = SamplingParams(temperature=0, num_tokens_to_generate=5)
    request = engine.add_request(prompt, params)
    engine.step()  # the 10 prompt tokens fill 3 blocks of 4
    assert len(request.block_ids) == 3
    assert engine.cache_stats()["kv_cache_usage"] == 3 / 64
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache_stats()["kv_cache_usage"] == 0.0  # cached blocks are free to take
    engine.generate([prompt], params)  # its first 8 tokens (2 whole blocks) come from the cache
    stats = engine.cache_stats()
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_query_tokens"]) == (8, 20)
    engine.suspend()
    assert engine.cache_stats()["kv_cache_usage"] == 0.0
