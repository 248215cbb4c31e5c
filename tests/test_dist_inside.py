"""Chapter 07's looks inside DDP and FSDP2 on real gloo ranks: when the bucketed all-reduces are called during
backward, and what ZeRO-2/3 hold and send per step, each against an independent single-process reference."""
import math

import pytest

from labkit import dist_demos
from labkit.dist import bucket_plan, launch

WORLD = 3  # 3 does not divide the toy model's rows: FSDP2's padded shards are tested too
BUCKETS_MB = (0.002, 0.01, 1.0)
BATCH = 6
LAYERS = 3  # the prefetch demo's blocks


@pytest.fixture(scope="module")
def demos():
    return launch(dist_demos.several, world_size=WORLD, backend="gloo", timeout=300, quiet=True, demos={
        "ddp_overlap": {"bucket_sizes_mb": BUCKETS_MB, "global_batch": BATCH}, "fsdp_inside": {"global_batch": BATCH},
        "fsdp_prefetch": {"global_batch": BATCH, "num_layers": LAYERS},
    })


def _toy():
    base, x, y = dist_demos._toy_setup(0, BATCH, 16)
    return base, x[dist_demos._local_slice(0, WORLD, BATCH)], y[dist_demos._local_slice(0, WORLD, BATCH)]


def _arrival_order():
    """The order backward produces the gradients, on one process without any DDP."""
    from labkit.train import cross_entropy

    model, x, y = _toy()
    order = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
    cross_entropy(model(x), y).backward()
    return order


def test_each_bucket_is_all_reduced_when_its_last_gradient_arrives(demos):
    model, _, _ = _toy()
    params = list(model.parameters())
    order = _arrival_order()
    for mb in BUCKETS_MB:
        plan = bucket_plan(params, max(1, int(mb * 2**20)))
        after = [len(order) - 1 - max(order.index(i) for i in bucket) for bucket in plan]
        nbytes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in plan]
        for rank in range(WORLD):
            r = demos[rank]["ddp_overlap"][mb]
            assert r["bucket_bytes"] == nbytes and r["grads_after_launch"] == after and r["gradients"] == len(params)
            assert r["call_bytes"] == [nbytes[b] for b in sorted(range(len(plan)), key=lambda b: -after[b])]
            assert [sum(t > call for t in r["arrival_ms"]) for call in r["call_ms"]] == sorted(after, reverse=True)
            assert r["call_ms"] == sorted(r["call_ms"]) and max(r["call_ms"]) < r["backward_ms"]
            assert 0 <= r["completed_at_backward_end"] <= len(plan)
    assert len(demos[0]["ddp_overlap"][BUCKETS_MB[0]]["bucket_bytes"]) > 2
    assert demos[0]["ddp_overlap"][1.0]["grads_after_launch"] == [0]  # one bucket: called with the last gradient


def _padded_shard_bytes(tensors):
    """FSDP2 splits dim 0 into WORLD chunks of ceil(rows / WORLD) rows and pads the last ones for the collectives."""
    return sum(math.ceil(t.shape[0] / WORLD) * (t.numel() // t.shape[0]) * t.element_size() for t in tensors)


def test_zero2_and_zero3_hold_and_send_what_the_shapes_say(demos):
    model, _, _ = _toy()
    unit = lambda name: ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
    by_unit = {}
    for name, p in model.named_parameters():
        by_unit.setdefault(unit(name), []).append(p)
    padded = {name: _padded_shard_bytes(ps) for name, ps in by_unit.items()}
    full = {name: sum(p.numel() * p.element_size() for p in ps) for name, ps in by_unit.items()}
    S, blocks, n = sum(padded.values()), sum(v for k, v in padded.items() if k != "root"), WORLD
    local = [{name: sum(min(math.ceil(p.shape[0] / n), max(0, p.shape[0] - r * math.ceil(p.shape[0] / n))) * (p.numel() // p.shape[0])
                        * p.element_size() for p in ps) for name, ps in by_unit.items()} for r in range(n)]
    for rank in range(n):
        z3, z2 = demos[rank]["fsdp_inside"]["zero3"], demos[rank]["fsdp_inside"]["zero2"]
        for r in (z3, z2):
            assert r["full"] == full and r["shard"] == local[rank] and r["grad_bytes"] == sum(local[rank].values())
            assert r["forward"] == {"all_gather": {"calls": len(full), "sent": (n - 1) * S}}
            assert r["backward"]["reduce_scatter"] == {"calls": len(full), "sent": pytest.approx((n - 1) * S)}
        assert z3["backward"]["all_gather"] == {"calls": len(full) - 1, "sent": (n - 1) * blocks}
        assert "all_gather" not in z2["backward"]
        assert z3["unsharded_after_forward"] == ["root"] and z2["unsharded_after_forward"] == sorted(full)
        assert z3["held_after_forward"] == sum(local[rank].values()) + full["root"]
        assert z2["held_after_forward"] == sum(local[rank].values()) + sum(full.values())
        bf16 = demos[rank]["fsdp_inside"]["zero3 bf16"]  # MixedPrecisionPolicy: bf16 all-gathers, fp32 reduce-scatters
        assert bf16["shard"] == local[rank] and bf16["grad_bytes"] == sum(local[rank].values())  # fp32 shards and gradients
        assert bf16["forward"] == {"all_gather": {"calls": len(full), "sent": (n - 1) * S // 2}}
        assert bf16["backward"]["all_gather"] == {"calls": len(full) - 1, "sent": (n - 1) * blocks // 2}
        assert bf16["backward"]["reduce_scatter"] == {"calls": len(full), "sent": pytest.approx((n - 1) * S)}
        assert bf16["held_after_forward"] == sum(local[rank].values()) + full["root"] // 2  # the gathered root in bf16


def test_explicit_forward_prefetch_issues_the_next_blocks_all_gather_before_this_block_runs(demos):
    model, _, _ = dist_demos._toy_setup(0, BATCH, 16, num_layers=LAYERS)
    root = _padded_shard_bytes([p for name, p in model.named_parameters() if not name.startswith("layers.")])
    block = _padded_shard_bytes(list(model.layers[0].parameters()))
    gather, reduce = ("all_gather", block), ("reduce_scatter", WORLD * block)
    default_forward = [("all_gather", root)] + [e for i in range(LAYERS) for e in (gather, ("forward", i))]
    explicit_forward = [("all_gather", root), gather] + [e for i in range(LAYERS) for e in [gather] * (i + 1 < LAYERS) + [("forward", i)]]
    # backward (the same in both: FSDP2 prefetches one unit ahead in backward by default): the last block is gathered
    # again, then each block's backward starts once the previous block's all-gather is issued, and its gradients are
    # reduce-scattered when it ends; the root's last
    backward = [gather] + [e for i in reversed(range(LAYERS)) for e in [gather] * (i > 0) + [("backward", i), reduce]]
    backward.append(("reduce_scatter", WORLD * root))
    for rank in range(WORLD):
        default, explicit = demos[rank]["fsdp_prefetch"]["default"], demos[rank]["fsdp_prefetch"]["explicit"]
        assert default["events"] == default_forward + backward and explicit["events"] == explicit_forward + backward
        assert default["gathers_at_forward"] == [i + 2 for i in range(LAYERS)]  # the root's and blocks 0..i
        assert explicit["gathers_at_forward"] == [min(i + 3, LAYERS + 1) for i in range(LAYERS)]  # ... and block i + 1
        for r in (default, explicit):
            assert r["gathers_at_backward"] == {i: min(LAYERS - i + 1, LAYERS) for i in range(LAYERS)}


def test_fsdp_prefetch_needs_two_blocks():
    with pytest.raises(ValueError, match="num_layers"):
        dist_demos.fsdp_prefetch(0, 1, num_layers=1)
