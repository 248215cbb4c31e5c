"""labkit.parallel_plan: memory agrees with chapter 07's estimator, parameters add up, layouts
and published configurations."""
import pytest

import labkit  # noqa: F401
from labkit import parallel_plan as PP
from labkit.memory import estimate_training_memory
from labkit.model import MOE_PRESETS, PRESETS, TransformerLM, count_parameters
from labkit.parallel import bubble_fraction, tp_comm_bytes


@pytest.mark.parametrize("name", ["qwen3-8b", "llama2-7b", "gemma-2b", "llama2-70b"])
@pytest.mark.parametrize("zero, checkpointing", [(0, False), (1, True), (3, False)])
def test_one_gpu_per_model_replica_is_chapter_07s_estimate(name, zero, checkpointing):
    config = PRESETS[name]
    plan = PP.parallel_plan(config, 8, 80, tp=[1], pp=[1], seq_len=2048, tokens_per_step=8 * 2048, zero_stage=zero,
                            activation_checkpointing=checkpointing, flash_attention=False)[0]
    assert (plan.dp, plan.micro_batches) == (8, 1)
    expected = estimate_training_memory(config, 1, 2048, param_dtype="bf16", mixed_precision=True, zero_stage=zero,
                                        world_size=8, activation_checkpointing=checkpointing)
    assert plan.memory.as_dict() == expected.as_dict()


@pytest.mark.parametrize("name", ["qwen3-8b", "gemma-2b", "llama2-70b"])
def test_parameters_of_all_shards_add_up_to_the_model(name):
    config = PRESETS[name]
    total = count_parameters(config)
    for pp in (1, 2, 4):
        layers = PP.split_layers(config.num_layers, pp)
        assert sum(PP.stage_parameters(config, 1, n, s == 0, s == pp - 1) for s, n in enumerate(layers)) == total + (
            config.vocab_size * config.d_model if config.tie_embeddings and pp > 1 else 0)  # a tied table lives on both ends
    tp = 2
    replicated = (2 * config.num_layers + 1) * config.d_model + (2 * config.dim_per_head * config.num_layers if config.qk_norm else 0)
    kv_copies = (tp // config.kv_heads - 1) * 2 * config.d_model * config.dim_per_head * config.num_layers if config.kv_heads < tp else 0
    assert tp * PP.stage_parameters(config, tp, config.num_layers, True, True) - (tp - 1) * replicated - kv_copies == total


def test_plans_tile_the_gpus_and_put_fitting_layouts_first():
    plans = PP.parallel_plan("llama3-70b", 64, 80, seq_len=8192, tokens_per_step=4 * 2**20, activation_checkpointing=True)
    assert plans and all(p.tp * p.pp * p.cp * p.dp == 64 for p in plans)
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)
    assert any(fits) and not all(fits)
    for p in plans:
        assert p.bubble == bubble_fraction(p.pp, p.micro_batches)
        assert p.fits == (p.memory.total <= 80e9)
        layers = max(PP.split_layers(80, p.pp))
        assert p.comm_bytes["tp"] == pytest.approx(tp_comm_bytes(1, 8192, 8192, p.tp, 2) * 1.5 * layers * p.micro_batches)
        assert p.links["tp"] == ("NVLink" if p.tp <= 8 else "InfiniBand")


def test_more_pipeline_stages_and_tensor_parallelism_shrink_memory():
    def total(tp, pp):
        return PP.parallel_plan("llama3-70b", 64, 80, tp=[tp], pp=[pp], seq_len=4096, tokens_per_step=2**20)[0].memory.total
    assert total(8, 1) < total(4, 1) < total(1, 1)
    assert total(1, 8) < total(1, 2) < total(1, 1)


def test_1f1b_holds_fewer_micro_batches_than_gpipe():
    config = PP.PLAN_PRESETS["llama3-70b"]
    kw = dict(micro_batches=16, micro_batch=1, seq_len=4096)
    gpipe = PP.stage_memory(config, 8, 4, 1, 2, 0, schedule="gpipe", **kw)
    one_f = PP.stage_memory(config, 8, 4, 1, 2, 0, **kw)
    assert gpipe.activations == 4 * one_f.activations  # 16 micro-batches held vs p = 4
    assert gpipe.model_state == one_f.model_state


@pytest.mark.parametrize("layout", PP.PUBLISHED_LAYOUTS, ids=lambda layout: f"{layout['gpus']} GPUs, CP{layout['cp']}")
def test_llama3_405b_published_layouts_fit_with_checkpointing_and_tp_inside_a_node(layout):
    plan = PP.published_layout_plan(layout, activation_checkpointing=True)
    assert plan.dp == layout["dp"] and plan.fits and plan.links["tp"] == "NVLink"
    assert not PP.published_layout_plan(layout, activation_checkpointing=False).fits  # the activations of 16 micro-batches
    assert plan.links["pp"] == plan.links["dp"] == "RoCE"  # Meta's 405B cluster: RDMA over Ethernet, not InfiniBand
    # each TP rank sends its 1/tp of every micro-batch's activation to the next stage, and of its gradient back
    assert plan.comm_bytes["pp"] == 2 * plan.micro_batches * (layout["seq_len"] // layout["cp"]) * 16384 * 2 / layout["tp"]


def test_llama3_405b_needs_pipeline_stages():
    # with TP8 inside the node, ZeRO-1 and checkpointing, 1 or 2 pipeline stages cannot hold the model state
    plans = PP.parallel_plan("llama3-405b", 16384, 80, tp=[8], seq_len=8192, tokens_per_step=16 * 2**20, activation_checkpointing=True)
    assert {p.pp for p in plans if not p.fits} >= {1, 2}
    assert 16 in {p.pp for p in plans if p.fits}


def test_validation():
    with pytest.raises(ValueError, match="config"):
        PP.parallel_plan("gpt-5", 8, 80)
    with pytest.raises(ValueError, match="interconnect"):
        PP.parallel_plan("qwen3-8b", 8, 80, "smoke signals")
    with pytest.raises(ValueError, match="gpu_memory"):
        PP.parallel_plan("qwen3-8b", 8, 0)
    with pytest.raises(ValueError, match="tp=3"):
        PP.stage_memory(PRESETS["qwen3-8b"], 3, 1, 1, 1, 0, 1, 1, 1024)
    with pytest.raises(ValueError, match="schedule"):
        PP.stage_memory(PRESETS["qwen3-8b"], 1, 1, 1, 1, 0, 1, 1, 1024, schedule="zb")
    with pytest.raises(ValueError, match="ep=.*mixture-of-experts"):
        PP.parallel_plan("qwen3-8b", 8, 80, ep=[2])
    with pytest.raises(ValueError, match="ep=3"):
        PP.stage_memory(MOE_PRESETS["mixtral-8x7b"], 1, 1, 1, 6, 0, 1, 1, 1024, ep=3)
    with pytest.raises(ValueError, match="ep=4"):  # 4 does not divide dp=2
        PP.stage_memory(MOE_PRESETS["mixtral-8x7b"], 1, 1, 1, 2, 0, 1, 1, 1024, ep=4)
    with pytest.raises(ValueError, match="tokens"):
        PP.expert_parallel_comm(0, 2, 64, 2, 2)


def test_strategy_memory_shows_why_to_split():
    memory = PP.strategy_memory("llama3-70b", 64, seq_len=4096)
    totals = {k: v.total for k, v in memory.items()}
    assert totals["DDP"] > totals["ZeRO-1"] > totals["ZeRO-3"]
    assert totals["TP8 + SP + ZeRO-1"] < totals["ZeRO-1"] and totals["TP8 x PP8 + SP + ZeRO-1"] < totals["TP8 + SP + ZeRO-1"]
    # plain TP (DDP over the other 8 ranks, no sequence parallelism) keeps whole norms' activations and full model state
    plain, full = memory["TP8 + DDP"], memory["TP8 + SP + ZeRO-1"]
    assert plain.activations > 3 * full.activations and plain.model_state > 2 * full.model_state and plain.total > 80e9 > full.total


# ----------------------------------------------------------------------------- mixture of experts
@pytest.mark.parametrize("name", sorted(MOE_PRESETS))
@pytest.mark.parametrize("zero, checkpointing", [(0, False), (1, True), (3, False)])
def test_moe_model_on_one_gpu_per_replica_is_chapter_07s_estimate(name, zero, checkpointing):
    config = MOE_PRESETS[name]
    plan = PP.parallel_plan(config, 8, 80, tp=[1], pp=[1], ep=[1], seq_len=2048, tokens_per_step=8 * 2048, zero_stage=zero,
                            activation_checkpointing=checkpointing, flash_attention=False)[0]
    expected = estimate_training_memory(config, 1, 2048, param_dtype="bf16", mixed_precision=True, zero_stage=zero,
                                        world_size=8, activation_checkpointing=checkpointing)
    assert plan.memory.as_dict() == expected.as_dict()
    assert "ep" in plan.comm_bytes and plan.comm_bytes["ep"] == 0


@pytest.mark.parametrize("name", sorted(MOE_PRESETS))
def test_moe_parameters_add_up_and_experts_split_across_ep(name):
    config = MOE_PRESETS[name]
    total = TransformerLM(config, device="meta").num_params()  # the model itself, not the formula
    assert count_parameters(config) == total
    for pp in (1, 2, 4):
        layers = PP.split_layers(config.num_layers, pp)
        starts = [sum(layers[:s]) for s in range(pp)]
        assert sum(PP.stage_parameters(config, 1, n, s == 0, s == pp - 1, first_layer=starts[s]) for s, n in enumerate(layers)) == total
    dense, experts = PP.stage_parameter_split(config, 1, config.num_layers, True, True)
    for ep in (2, 8):
        dense_ep, experts_ep = PP.stage_parameter_split(config, 1, config.num_layers, True, True, ep=ep)
        assert dense_ep == dense and experts_ep * ep == experts


def test_expert_parallelism_trades_memory_for_all_to_all_traffic():
    config = MOE_PRESETS["mixtral-8x7b"]
    plans = {e: PP.parallel_plan(config, 64, 80, tp=[1], pp=[2], ep=[e], seq_len=4096, tokens_per_step=2**20,
                                 activation_checkpointing=True)[0] for e in (1, 2, 8)}
    assert plans[1].memory.model_state > plans[2].memory.model_state > plans[8].memory.model_state
    assert plans[1].comm_bytes["ep"] == 0 < plans[2].comm_bytes["ep"] < plans[8].comm_bytes["ep"]
    assert plans[8].layout == "TP1 x PP2 x CP1 x DP32 (EP8)"
    moe_layers = 16  # of the 32 on each of two stages: every layer is MoE
    expected = 6 * moe_layers * plans[8].micro_batches * (7 / 8) * 4096 * 2 * config.d_model * 2  # k = 2 rows per token, bf16
    assert plans[8].comm_bytes["ep"] == pytest.approx(expected)
    assert plans[8].links["ep"] == "NVLink" and PP.parallel_plan(config, 64, 80, tp=[2], pp=[1], ep=[8], seq_len=4096,
                                                                 tokens_per_step=2**20)[0].links["ep"] == "InfiniBand"
    dense = PP.parallel_plan("qwen3-8b", 64, 80, tp=[1], pp=[2], seq_len=4096, tokens_per_step=2**20)[0]
    assert "ep" not in dense.comm_bytes and "(EP" not in dense.layout


def test_tp_compute_to_comm_is_the_closed_form_and_says_where_tp_stops_paying():
    config = PP.PLAN_PRESETS["llama3-70b"]
    d, kv = config.d_model, config.kv_heads * config.dim_per_head
    layer = 2 * d * d + 2 * d * kv + 3 * d * config.d_ff + 2 * d  # q, o; k, v; SwiGLU; two RMSNorm gains
    for tp in (2, 8, 16):
        expected = 6 * layer * 450e9 / (8 * (tp - 1) * d * 2 * 0.4 * PP.H100_BF16_FLOPS)
        assert PP.tp_compute_to_comm(config, tp, 450e9) == pytest.approx(expected)
    assert PP.tp_compute_to_comm("llama3-70b", 8, 450e9) > 1 > PP.tp_compute_to_comm("llama3-70b", 16, 50e9)
    assert PP.tp_compute_to_comm("llama3-405b", 8, 450e9) > PP.tp_compute_to_comm("llama3-70b", 8, 450e9)  # grows with d_model
    with pytest.raises(ValueError, match="tp"):
        PP.tp_compute_to_comm(config, 1, 450e9)
    with pytest.raises(ValueError, match="dense"):
        PP.tp_compute_to_comm("mixtral-8x7b", 2, 450e9)


def test_mesh_groups_lay_ranks_out_row_by_row():
    sizes = {"dp": 2, "pp": 2, "cp": 1, "tp": 4}
    groups = PP.mesh_groups(sizes)
    assert groups["tp"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["pp"][0] == [0, 4] and groups["dp"][0] == [0, 8] and groups["cp"][0] == [0]
    # independent check: decode every rank's coordinates; a group's ranks differ only along its dimension
    shape = list(sizes.values())

    def coords(rank):
        out = []
        for n in reversed(shape):
            rank, c = divmod(rank, n)
            out.append(c)
        return out[::-1]

    for axis, name in enumerate(sizes):
        assert sorted(r for g in groups[name] for r in g) == list(range(16))
        for g in groups[name]:
            assert len(g) == shape[axis]
            rest = {tuple(c for i, c in enumerate(coords(r)) if i != axis) for r in g}
            assert len(rest) == 1
    import torch

    mesh = torch.arange(16).reshape(shape)  # what DeviceMesh holds for init_device_mesh(..., (2, 2, 1, 4))
    assert groups["tp"] == mesh.reshape(-1, 4).tolist()
    with pytest.raises(ValueError, match="sizes"):
        PP.mesh_groups({})
