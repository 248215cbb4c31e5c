"""labkit.serving's engine core: the block manager, the scheduler's plan, the packed forward pass and the engine.

The key property: whatever the mix of requests, the engine's greedy outputs equal each request decoded alone with
``labkit.model.generate(temperature=0)``, token for token, with and without prefix caching and chunked prefill, and
with preemption forced by a small pool; afterwards every block is back on the free list with refcount 0."""
from __future__ import annotations

import random

import pytest
import torch

from labkit.attention_variants import PagedKVCache, paged_attention
from labkit.model import TransformerLM, generate, tiny_config
from labkit.serving import BlockManager, Engine, PoolExhaustedError, SamplingParams, SeqState, plan_step
from labkit.serving.runner import forward_packed, pack_batch
from labkit.serving.workload import (compare_batching, decode_cost, kv_usage, metrics, mixed_workload, percentile,
                                     serve)

VOCAB = 48


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TransformerLM(tiny_config(VOCAB, context_length=96)).eval()


@pytest.fixture(scope="module")
def gqa_model():
    torch.manual_seed(1)
    return TransformerLM(tiny_config(VOCAB, context_length=96, num_kv_heads=2, qk_norm=True)).eval()


def random_requests(seed: int, count: int = 8, shared_prefix: int = 12):
    """Prompts of 1..24 tokens, half starting with a shared prefix (some exactly a whole number of blocks, so the
    prefix cache covers a whole prompt), outputs of 1..12 tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    requests = []
    for i in range(count):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        prompt = prefix + tail if i % 2 else tail + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
        if i == 3:
            prompt = list(prefix)  # the whole prompt is cached once an earlier request computed it
        requests.append((prompt, rng.randint(1, 12)))
    return requests


def alone(model, prompt, max_new_tokens):
    return generate(model, torch.tensor(prompt), max_new_tokens)[len(prompt):].tolist()


def assert_all_blocks_returned(engine: Engine):
    manager = engine.blocks
    assert manager.num_free_blocks == manager.num_blocks
    assert all(manager.refcount(b) == 0 for b in range(manager.num_blocks))
    assert not manager.block_tables and not engine.running and not engine.waiting


CONFIGS = {
    "default": dict(block_size=4, num_blocks=64, max_batch_tokens=32, max_num_seqs=8),
    "no prefix caching": dict(block_size=4, num_blocks=64, max_batch_tokens=32, max_num_seqs=8, prefix_caching=False),
    "no chunked prefill": dict(block_size=4, num_blocks=64, max_batch_tokens=48, max_num_seqs=8,
                               chunked_prefill=False),
    "tiny budget, 1-token blocks": dict(block_size=1, num_blocks=64, max_batch_tokens=3, max_num_seqs=3),
    "small pool (preemption)": dict(block_size=4, num_blocks=10, max_batch_tokens=16, max_num_seqs=6),
    "static batching": dict(block_size=4, num_blocks=64, max_batch_tokens=8, max_num_seqs=4, batching="static"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_outputs_equal_each_request_decoded_alone(model, name, seed):
    requests = random_requests(seed)
    engine = Engine(model, **CONFIGS[name])
    ids = [engine.add_request(prompt, n) for prompt, n in requests]
    outputs = {o.request_id: o for o in engine.run()}
    for request_id, (prompt, n) in zip(ids, requests):
        assert list(outputs[request_id].prompt_ids) == prompt
        assert list(outputs[request_id].output_ids) == alone(model, prompt, n), f"request {request_id} ({name})"
    assert_all_blocks_returned(engine)
    stats = engine.stats
    assert stats.generated_tokens == sum(n for _, n in requests)
    if name == "small pool (preemption)":
        assert stats.preemptions > 0 and any(o.num_preemptions for o in outputs.values())
    if CONFIGS[name].get("prefix_caching", True) and name != "small pool (preemption)":
        assert stats.prefix_hit_rate > 0 and any(o.num_cached_tokens for o in outputs.values())


@pytest.mark.parametrize("seed", range(4))
def test_random_engine_settings_with_a_pool_just_big_enough(model, seed):
    """Random block size, budget, batch limit and switches; the pool holds the largest request and little more, so
    requests preempt each other often."""
    rng = random.Random(100 + seed)
    requests = random_requests(seed + 10, count=rng.randint(4, 9))
    block_size = rng.choice([1, 2, 4, 8])
    largest = max(-(-(len(p) + n - 1) // block_size) for p, n in requests)
    chunked = rng.random() < 0.7
    budget = rng.choice([4, 16, 64]) if chunked else 64
    engine = Engine(model, block_size, largest + rng.randint(0, 3), budget, max_num_seqs=rng.randint(1, 6),
                    chunked_prefill=chunked, prefix_caching=rng.random() < 0.7)
    ids = [engine.add_request(prompt, n) for prompt, n in requests]
    outputs = {o.request_id: o for o in engine.run()}
    for request_id, (prompt, n) in zip(ids, requests):
        assert list(outputs[request_id].output_ids) == alone(model, prompt, n)
    assert_all_blocks_returned(engine)


def test_gqa_qk_norm_model_and_requests_arriving_while_others_run(gqa_model):
    requests = random_requests(5, count=10)
    engine = Engine(gqa_model, block_size=2, num_blocks=40, max_batch_tokens=20, max_num_seqs=5)
    ids, outputs = {}, {}
    for prompt, n in requests:  # one new request per step: admissions mix with decodes and chunks
        ids[engine.add_request(prompt, n)] = (prompt, n)
        outputs.update({o.request_id: o for o in engine.step()})
    outputs.update({o.request_id: o for o in engine.run()})
    for request_id, (prompt, n) in ids.items():
        assert list(outputs[request_id].output_ids) == alone(gqa_model, prompt, n)
    assert_all_blocks_returned(engine)


def test_a_chunk_mixes_with_decodes_in_one_step(model):
    engine = Engine(model, block_size=4, num_blocks=64, max_batch_tokens=8, max_num_seqs=4)
    engine.add_request([1, 2, 3], 6)
    engine.step()
    engine.add_request(list(range(20)), 2)
    engine.step()
    kinds = engine.trace[-1].scheduled
    assert kinds == ((0, "decode", 1), (1, "prefill", 7)), kinds  # the decode first, the chunk fills the budget
    assert "decode 0 | prefill 1:7" in engine.trace[-1].describe()


def test_copy_on_write_keeps_the_other_requests_kv(model):
    """Two requests with the same 8-token prompt (2 full blocks): the second is given both cached blocks and must
    recompute its last token, which lies in a block the first still holds: that block is copied first."""
    engine = Engine(model, block_size=4, num_blocks=32, max_batch_tokens=32, max_num_seqs=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    first = engine.add_request(prompt, 6)
    engine.step()
    engine.step()
    table_first = list(engine.blocks.block_tables[first])
    k_before, v_before = engine.cache.k[:, table_first].clone(), engine.cache.v[:, table_first].clone()
    second = engine.add_request(prompt, 4)
    engine.step()
    table_second = engine.blocks.block_tables[second]
    assert table_second[0] == table_first[0] and engine.blocks.refcount(table_first[0]) == 2  # shared, not copied
    assert table_second[1] != table_first[1]  # the block it wrote into was copied
    assert torch.equal(engine.cache.k[:, table_first[:2]], k_before[:, :2])
    assert torch.equal(engine.cache.v[:, table_first[:2]], v_before[:, :2])
    outputs = {o.request_id: o for o in engine.run()}
    assert list(outputs[first].output_ids) == alone(model, prompt, 6)
    assert list(outputs[second].output_ids) == alone(model, prompt, 4)
    assert outputs[second].num_cached_tokens == 7
    usage = kv_usage(engine.trace, 4, model.config.context_length)
    assert all(u.used <= u.paged <= u.contiguous for u in usage)  # a shared block's slots are counted once
    assert_all_blocks_returned(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = SamplingParams(temperature=1.0, top_k=10, seed=123)

    def sampled(others: int):
        engine = Engine(model, block_size=4, num_blocks=64, max_batch_tokens=64, max_num_seqs=8)
        for i in range(others):
            engine.add_request([i + 1] * (i + 2), 5)
        target = engine.add_request([3, 1, 4, 1, 5], 8, sampling=params)
        return {o.request_id: o for o in engine.run()}[target].output_ids

    assert sampled(0) == sampled(5)


# ----------------------------------------------------------------------------- errors
def test_a_request_that_can_never_fit_raises_at_add_request(model):
    engine = Engine(model, block_size=4, num_blocks=3, max_batch_tokens=16)
    with pytest.raises(ValueError, match="num_blocks=3: it can never fit"):
        engine.add_request(list(range(10)), 5)  # 14 tokens of K/V need 4 blocks
    engine.add_request(list(range(10)), 3)  # 12 tokens: exactly the pool
    with pytest.raises(ValueError, match="context_length"):
        Engine(model, 4, 64, 16).add_request([1] * 90, 10)
    with pytest.raises(ValueError, match="max_batch_tokens=8"):
        Engine(model, 4, 64, 8, chunked_prefill=False).add_request([1] * 9, 1)
    assert len(engine.run()) == 1


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(block_size=0), ValueError, "block_size"), (dict(num_blocks=2.0), ValueError, "num_blocks"),
    (dict(max_batch_tokens=True), ValueError, "max_batch_tokens"), (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(chunked_prefill=1), TypeError, "chunked_prefill"), (dict(prefix_caching="yes"), TypeError, "prefix_caching"),
    (dict(batching="dynamic"), ValueError, "batching"),
])
def test_bad_engine_arguments_are_named(model, kwargs, error, name):
    args = dict(block_size=4, num_blocks=16, max_batch_tokens=16)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        Engine(model, **args)


@pytest.mark.parametrize("args, error, name", [
    (([], 3), ValueError, "prompt_ids"), (([1, VOCAB], 3), ValueError, "prompt_ids"),
    (("abc", 3), TypeError, "prompt_ids"), ((torch.ones(2, 2, dtype=torch.long), 3), ValueError, "prompt_ids"),
    (([1, 2], 0), ValueError, "max_new_tokens"), (([1, 2], 2.5), ValueError, "max_new_tokens"),
])
def test_bad_request_arguments_are_named(model, args, error, name):
    with pytest.raises(error, match=name):
        Engine(model, 4, 16, 16).add_request(*args)
    with pytest.raises(TypeError, match="sampling"):
        Engine(model, 4, 16, 16).add_request([1], 1, sampling={"temperature": 1})
    with pytest.raises(TypeError, match="model"):
        Engine(object(), 4, 16, 16)


# ----------------------------------------------------------------------------- block manager
def test_block_manager_refcounts_fork_and_copy_on_write():
    manager = BlockManager(num_blocks=6, block_size=4, prefix_caching=False)
    manager.add_sequence("a")
    assert manager.grow("a", 6) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    manager.fork("a", "b")
    assert manager.block_tables["b"] == [0, 1] and manager.refcount(0) == manager.refcount(1) == 2
    slots = manager.grow("b", 1)  # into shared block 1: copied to a fresh block first
    assert manager.take_copies() == [(1, 2)] and manager.take_copies() == []
    assert slots == [(2, 2)] and manager.block_tables["b"] == [0, 2] and manager.block_tables["a"] == [0, 1]
    assert (manager.refcount(0), manager.refcount(1), manager.refcount(2)) == (2, 1, 1)
    manager.grow("a", 1)  # block 1 is a's alone now: written in place
    assert manager.take_copies() == [] and manager.block_tables["a"] == [0, 1]
    with pytest.raises(PoolExhaustedError):
        manager.grow("a", 20)
    assert manager.lengths["a"] == 7 and manager.num_free_blocks == 3  # a failed grow changes nothing
    manager.free("a")
    assert manager.refcount(0) == 1 and manager.refcount(1) == 0 and manager.num_free_blocks == 4
    manager.free("b")
    assert manager.num_free_blocks == 6 and all(manager.refcount(b) == 0 for b in range(6))


def test_prefix_cache_names_full_blocks_and_keeps_freed_ones_findable():
    manager = BlockManager(num_blocks=8, block_size=2)
    manager.add_sequence(0)
    manager.grow(0, 5, [1, 2, 3, 4, 5])
    assert manager.num_cached_blocks == 2  # two full blocks named, the partial third one not
    assert manager.cached_prefix_length([1, 2, 3, 4, 9, 9]) == 4
    assert manager.cached_prefix_length([1, 2, 3, 4]) == 3  # the last token is always computed
    assert manager.cached_prefix_length([2, 1, 3, 4]) == 0  # same block contents after another prefix: no hit
    manager.free(0)
    manager.add_sequence(1)
    assert manager.allocate_cached_prefix(1, [1, 2, 3, 4, 7]) == 4  # freed blocks are still found
    assert manager.block_tables[1] == [0, 1] and manager.refcount(0) == 1
    assert manager.hit_rate == pytest.approx(4 / 5)
    manager.grow(1, 1, [7])
    manager.add_sequence(2)
    manager.grow(2, 8, list(range(10, 18)))  # takes every free block: the old partial block 2 is reused
    assert manager.num_free_blocks == 1
    manager.free(1)
    manager.free(2)
    assert manager.num_free_blocks == 8


def test_block_manager_arguments_are_checked():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(TypeError, match="prefix_caching"):
        BlockManager(4, 4, prefix_caching=None)
    manager = BlockManager(4, 4)
    with pytest.raises(ValueError, match="seq_id"):
        manager.grow("missing", 1)
    manager.add_sequence(0)
    with pytest.raises(ValueError, match="token_ids"):
        manager.grow(0, 2, [1])
    with pytest.raises(ValueError, match="block"):
        manager.refcount(4)


def test_the_manager_is_chapter_03s_paged_cache_allocator():
    """The engine's pools are a PagedKVCache's, its allocator the BlockManager: chapter 03's paged_attention reads
    the engine's cache through it."""
    torch.manual_seed(0)
    cache = PagedKVCache(1, 8, 4, 2, 8)
    cache.allocator = BlockManager(8, 4)
    cache.add_sequence(0)
    k, v = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    cache.append(0, 0, k, v)
    q = torch.randn(4, 1, 8)
    table = torch.tensor(cache.allocator.block_tables[0], dtype=torch.int32)
    batch = (q.transpose(0, 1), table[None], torch.zeros(1, dtype=torch.long), torch.tensor([5]))
    from labkit.kernels.paged_attention import paged_attention_varlen

    ours = paged_attention_varlen(batch[0], cache.k[0], cache.v[0], *batch[1:])
    torch.testing.assert_close(ours.transpose(0, 1), paged_attention(q, cache, 0))


def test_forward_packed_matches_the_model_on_each_sequence(model):
    cache = PagedKVCache(2, 16, 4, 4, 16)
    manager = cache.allocator = BlockManager(16, 4)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    chunks = []
    for i, prompt in enumerate(prompts):
        manager.add_sequence(i)
        manager.grow(i, len(prompt), prompt)
        chunks.append((prompt, 0, manager.block_tables[i]))
    logits = forward_packed(model, cache, pack_batch(chunks, 4))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[i], model(torch.tensor(prompt))[-1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="chunks"):
        pack_batch([([1, 2, 3, 4, 5], 0, [0])], 4)


# ----------------------------------------------------------------------------- the scheduler's plan
def state(request_id, num_tokens, num_computed, num_blocks, shared=0):
    return SeqState(request_id, num_tokens, num_computed, num_blocks, shared)


def test_plan_decodes_first_then_chunks_under_the_budget():
    running = [state(0, 9, 8, 2), state(1, 5, 4, 1)]
    waiting = [state(2, 30, 0, 0), state(3, 4, 0, 0)]
    plan = plan_step(running, waiting, free_blocks=20, block_size=4, max_batch_tokens=12, max_num_seqs=8)
    assert plan.scheduled == {0: 1, 1: 1, 2: 10} and plan.admitted == [2] and plan.preempted == []
    unchunked = plan_step(running, waiting, 20, 4, 12, 8, chunked_prefill=False)
    assert unchunked.scheduled == {0: 1, 1: 1}  # request 2's prompt does not fit: no one overtakes it
    assert plan_step(running, waiting, 20, 4, 40, 3).admitted == [2]  # max_num_seqs=3


def test_plan_preempts_the_newest_running_request_when_blocks_run_out():
    running = [state(0, 9, 8, 2), state(1, 13, 12, 3), state(2, 5, 4, 1, shared=1)]
    plan = plan_step(running, [state(3, 4, 0, 0)], free_blocks=0, block_size=4, max_batch_tokens=16, max_num_seqs=8)
    # request 0 needs a third block: request 2 is freed (but its one block is shared: nothing gained), then request 1
    assert plan.preempted == [2, 1] and plan.scheduled == {0: 1} and plan.admitted == []
    alone_plan = plan_step([state(0, 9, 8, 2)], [], 0, 4, 16, 8)
    assert alone_plan.preempted == [0] and alone_plan.scheduled == {}


def test_plan_arguments_are_checked():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        plan_step([], [], 4, 4, 0, 4)
    with pytest.raises(ValueError, match="free_blocks"):
        plan_step([], [], -1, 4, 8, 4)
    with pytest.raises(ValueError, match="num_computed"):
        state(0, 4, 4, 1)


# ----------------------------------------------------------------------------- workload and metrics
def test_a_static_batch_pads_to_its_longest_member_and_releases_together(model):
    engine = Engine(model, block_size=4, num_blocks=64, max_batch_tokens=8, max_num_seqs=3, batching="static")
    for prompt, n in [([1, 2, 3], 2), ([4, 5], 7), ([6], 3), ([7, 8], 1)]:
        engine.add_request(prompt, n)
    first_batch = []
    while not first_batch:
        first_batch = engine.step()
    assert sorted(o.request_id for o in first_batch) == [0, 1, 2]  # all three leave together, after 7 tokens
    assert engine.stats.computed_tokens == 6 + 3 * 6  # three prompts, then 6 decode steps of the whole batch
    assert [len(o.output_ids) for o in sorted(first_batch, key=lambda o: o.request_id)] == [2, 7, 3]
    with pytest.raises(ValueError, match="never fit"):  # a static batch also needs each member to fit alone
        Engine(model, 4, 2, 8, batching="static").add_request([1] * 8, 2)


def test_continuous_batching_needs_far_fewer_steps_than_static(model):
    """The cause of the throughput gap, counted (not timed): a static batch runs until its longest member is done."""
    workload = mixed_workload(24, VOCAB, prompt_len=(4, 16), short_output=(2, 6), long_output=(36, 40),
                              long_fraction=0.2, seed=3)
    results = compare_batching(model, workload, block_size=4, num_blocks=256, max_batch_tokens=128, max_num_seqs=8)
    steps = {name: len(r.trace) for name, r in results.items()}
    assert steps["static"] >= 2 * steps["continuous"], steps
    expected = [alone(model, list(r.prompt_ids), r.max_new_tokens) for r in workload]
    for result in results.values():
        assert [list(o.output_ids) for o in result.outputs] == expected
    m = metrics(results["static"])
    assert m.generated_tokens == sum(r.max_new_tokens for r in workload) and m.tokens_per_s > 0
    usage = kv_usage(results["continuous"].trace, 4, model.config.context_length)
    assert all(u.used <= u.paged <= u.contiguous for u in usage)


def test_decode_cost_fits_a_fixed_and_a_per_token_part(model):
    cost = decode_cost(model, batch_sizes=(1, 4), prompt_len=4, steps=3)
    assert cost.batch_sizes == (1, 4) and len(cost.step_seconds) == 2 and all(t > 0 for t in cost.step_seconds)
    assert cost.fixed + 4 * cost.per_token == pytest.approx(cost.step_seconds[1])  # a line through two points
    with pytest.raises(ValueError, match="batch_sizes"):
        decode_cost(model, batch_sizes=(0,))


def test_mixed_workload_is_seeded_and_arrivals_are_poisson_like():
    a = mixed_workload(200, 100, rate=50.0, seed=7)
    assert a == mixed_workload(200, 100, rate=50.0, seed=7) and a != mixed_workload(200, 100, rate=50.0, seed=8)
    gaps = [y.arrival - x.arrival for x, y in zip(a, a[1:])]
    assert 0.015 < sum(gaps) / len(gaps) < 0.025  # mean gap 1/rate
    shared = mixed_workload(5, 100, shared_prefix_len=5)
    assert all(r.prompt_ids[:5] == shared[0].prompt_ids[:5] for r in shared)
    with pytest.raises(ValueError, match="rate"):
        mixed_workload(3, 10, rate=0)
    with pytest.raises(ValueError, match="prompt_len"):
        mixed_workload(3, 10, prompt_len=(5, 2))


def test_serve_waits_for_arrivals(model):
    clock = {"now": 0.0}
    engine = Engine(model, 4, 32, 32, clock=lambda: clock["now"])

    def sleep(seconds):
        clock["now"] += seconds

    workload = mixed_workload(3, VOCAB, rate=1.0, seed=0, long_fraction=0.0)
    result = serve(engine, workload, sleep=sleep)
    assert [o.arrival_time for o in result.outputs] == [r.arrival for r in workload]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
