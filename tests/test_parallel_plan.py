"""labkit.parallel_plan: memory agrees with chapter 07's estimator, parameters add up, layouts
and published configurations."""
import pytest

import labkit  # noqa: F401
from labkit import parallel_plan as PP
from labkit.memory import estimate_training_memory
from labkit.model import PRESETS, count_parameters
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
    with pytest.raises(ValueError, match="mixture"):
        PP.parallel_plan(PP.PLAN_PRESETS["qwen3-8b"].__class__(**{**PRESETS["qwen3-8b"].__dict__,
                                                                   "moe": {"num_experts": 4, "top_k": 1}}), 8, 80)


def test_strategy_memory_shows_why_to_split():
    memory = PP.strategy_memory("llama3-70b", 64, seq_len=4096)
    totals = {k: v.total for k, v in memory.items()}
    assert totals["DDP"] > totals["ZeRO-1"] > totals["ZeRO-3"]
    assert totals["TP8"] < totals["ZeRO-1"] and totals["TP8 x PP8"] < totals["TP8"]
