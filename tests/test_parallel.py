"""labkit.parallel: tensor, sequence, pipeline and context parallelism on 2 and 4 gloo ranks,
against the single-process modules, with the communication meter against the formulas.

Two launches (2 and 4 ranks) run every distributed check of this file (process start-up and
`import torch` cost seconds per launch); the rest are plain unit tests."""
import pytest
import torch

import labkit  # noqa: F401
from labkit import parallel as P
from labkit import parallel_demos
from labkit.dist import launch

TOL = 1e-5


@pytest.fixture(scope="module")
def two():
    return launch(parallel_demos.several, world_size=2, backend="gloo", timeout=300, quiet=True, demos={
        "tensor_parallel_layers": {}, "tensor_parallel_training": {"steps": 2}, "torch_tensor_parallel": {},
        "pipeline_training": {"micro_batches": 4}, "ring_attention_check": {}, "expert_parallel_traffic": {},
        "pipeline_timing": {"micro_batch_counts": (1, 8)}, "torch_pipelining": {}, "vocab_parallel_loss": {},
        "context_parallel_check": {},
    })


@pytest.fixture(scope="module")
def four():
    return launch(parallel_demos.several, world_size=4, backend="gloo", timeout=300, quiet=True, demos={
        "tensor_parallel_layers": {}, "pipeline_training": {"micro_batches": 6, "micro_batch": 1, "steps": 1},
        "ring_attention_check": {}, "torch_tensor_parallel": {}, "torch_pipelining": {"micro_batches": 4, "micro_batch": 1},
        "vocab_parallel_loss": {}, "context_parallel_check": {},
    })


def _runs(request, name):
    return request.getfixturevalue(name)


# ----------------------------------------------------------------------------- tensor parallelism
@pytest.mark.parametrize("world", ["two", "four"])
@pytest.mark.parametrize("kind", ["mlp", "attention", "block", "block_sp"])
def test_tensor_parallel_modules_equal_the_single_process_module(request, world, kind):
    runs = _runs(request, world)
    for rank in runs:
        r = runs[rank]["tensor_parallel_layers"][kind]
        for what in ("output", "input_grad", "weight_grad", "after_step"):
            assert r[what] < 5 * TOL, (rank, kind, what, r[what])  # fp32 sums in another order (up to ~7e-6 seen)
        assert r["local_params"] < r["full_params"]  # each rank really holds only a slice


@pytest.mark.parametrize("world", ["two", "four"])
def test_meter_counts_the_predicted_collectives_and_bytes(request, world):
    runs = _runs(request, world)
    for rank in runs:
        r = runs[rank]["tensor_parallel_layers"]
        predicted = r["predicted"]
        for kind, key in (("mlp", "sublayer"), ("attention", "sublayer"), ("block", "block"), ("block_sp", "block_sp")):
            for direction in ("forward", "backward"):
                assert r[kind][direction] == predicted[key][direction], (rank, kind, direction)
        # sequence parallelism sends the same bytes as the all-reduces it replaces
        sent = lambda passes: sum(op["sent"] for op in passes.values())  # noqa: E731
        assert sent(r["block_sp"]["forward"]) == sent(r["block"]["forward"])
        # QK-norm weights see only this rank's heads: a small all-reduce after backward
        assert r["attention"]["gradient_sync"]["all_reduce"]["calls"] == 2
        assert r["block_sp"]["gradient_sync"]["all_reduce"]["calls"] == 4  # + ln1, ln2 over the sequence shards


def test_the_collectives_measured_are_the_ones_tp_collectives_names(two):
    r = two[0]["tensor_parallel_layers"]
    for sp, kind in ((False, "block"), (True, "block_sp")):
        column, row = P.tp_collectives("column", sp), P.tp_collectives("row", sp)
        for direction, index in (("forward", 0), ("backward", 1)):
            expected = {op for op in (column[index], row[index]) if op}
            assert set(r[kind][direction]) == expected


def test_sequence_parallelism_saves_activation_memory(two):
    r = two[0]["tensor_parallel_layers"]
    assert r["block_sp"]["saved_bytes"] < r["block"]["saved_bytes"] < r["single_process_saved_bytes"]


def test_tensor_parallel_training_matches_one_process(two):
    for rank in two:
        out = two[rank]["tensor_parallel_training"]
        assert out["losses"] == pytest.approx(out["reference_losses"], rel=1e-5)
        assert out["local_param_elements"] < out["full_param_elements"]


@pytest.mark.parametrize("world", ["two", "four"])
def test_labkit_tensor_parallel_agrees_with_torch_colwise_rowwise(request, world):
    runs = _runs(request, world)
    for rank in runs:
        r = runs[rank]["torch_tensor_parallel"]
        assert max(r["output"], r["input_grad"], r["weight_grad"]) < TOL
        assert r["ours_forward"] == r["torch_forward"] == {"all_reduce": 1}  # g after the row-parallel w2
        # backward: torch all-reduces the input gradient of w1 and of w3 separately; labkit's one f sums them first
        assert r["torch_backward"] == {"all_reduce": 2} and r["ours_backward"] == {"all_reduce": 1}


# ----------------------------------------------------------------------------- pipeline parallelism
@pytest.mark.parametrize("world", ["two", "four"])
def test_pipeline_schedules_train_like_one_process(request, world):
    runs = _runs(request, world)
    last = max(runs)
    for schedule in ("gpipe", "1f1b"):
        assert runs[last]["pipeline_training"][schedule]["losses"] == pytest.approx(runs[last]["pipeline_training"]["reference_losses"], rel=1e-5)
        for rank in runs:
            assert runs[rank]["pipeline_training"][schedule]["param_diff"] < TOL


@pytest.mark.parametrize("world", ["two", "four"])
def test_activation_memory_per_stage_gpipe_holds_m_1f1b_at_most_p_minus_stage(request, world):
    runs = _runs(request, world)
    p = len(runs)
    for rank in runs:
        out = runs[rank]["pipeline_training"]
        m = len(out["gpipe"]["events"]) // 2
        one = out["gpipe"]["activation_bytes_per_micro_batch"]
        assert out["gpipe"]["peak_activation_bytes"] == m * one
        assert out["1f1b"]["peak_activation_bytes"] == min(p - rank, m) * one


def test_pipeline_messages_match_the_prediction(two):
    steps = 2
    for rank in two:
        out = two[rank]["pipeline_training"]["1f1b"]
        predicted = out["predicted"]
        assert out["comm"]["send"]["calls"] == steps * predicted["sends"]
        assert out["comm"]["send"]["bytes"] == steps * predicted["bytes_sent"]


def test_measured_bubble_follows_the_formula(two):
    # Wall-clock measurements on a shared machine (other programs, message latency, unequal stages push the
    # bubble up): one micro-batch idles at least (p-1)/p (the stages take turns), more micro-batches shrink it.
    events = two[0]["pipeline_timing"]
    for schedule in ("gpipe", "1f1b"):
        bubbles = {m: P.measured_bubble({rank: two[rank]["pipeline_timing"][(schedule, m)] for rank in two}) for m in (1, 8)}
        assert P.bubble_fraction(2, 1) - 0.02 <= bubbles[1] <= 1.0, (schedule, bubbles)
        assert bubbles[8] < bubbles[1], (schedule, bubbles)
    assert [e[:2] for e in events[("1f1b", 8)]] == P.one_f_one_b_schedule(2, 8, 0)


@pytest.mark.parametrize("world", ["two", "four"])
def test_pipeline_schedules_agree_with_torch_distributed_pipelining(request, world):
    # torch's own engine (PipelineStage + ScheduleGPipe / Schedule1F1B) on a copy of each stage: the same
    # loss and the same accumulated gradients, on every stage (the middle ones too with four ranks).
    runs = _runs(request, world)
    last = max(runs)
    for rank in runs:
        for schedule in ("gpipe", "1f1b"):
            result = runs[rank]["torch_pipelining"][schedule]
            assert result["grad_norm"] > 0, (rank, schedule)
            assert result["grad_diff"] < 1e-6, (rank, schedule, result)
    for schedule in ("gpipe", "1f1b"):
        assert runs[last]["torch_pipelining"][schedule]["loss_diff"] < 1e-5


def test_schedules_and_their_simulated_bubble():
    assert P.gpipe_schedule(2, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert P.one_f_one_b_schedule(4, 6, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5),
                                               ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert P.one_f_one_b_schedule(4, 6, 3) == [a for i in range(6) for a in (("F", i), ("B", i))]
    for p, m in [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3)]:
        for schedule in ("gpipe", "1f1b"):
            plan = P.SCHEDULES[schedule]
            for s in range(p):
                actions = plan(p, m, s)
                assert sorted(actions) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            simulated = P.simulate_schedule(schedule, p, m)
            assert P.measured_bubble(simulated) == pytest.approx(P.bubble_fraction(p, m))
    assert P.bubble_fraction(4, 8) == 3 / 11
    with pytest.raises(ValueError, match="stage"):
        P.gpipe_schedule(2, 2, 2)
    with pytest.raises(ValueError, match="micro_batches"):
        P.bubble_fraction(2, 0)
    with pytest.raises(ValueError, match="schedule"):
        P.simulate_schedule("zb", 2, 2)


def test_simulate_schedule_takes_any_order_and_names_a_deadlock():
    orders = {s: P.one_f_one_b_schedule(3, 4, s) for s in range(3)}
    assert P.simulate_schedule(orders, 3, 4) == P.simulate_schedule("1f1b", 3, 4)
    # stage 0 warms up with one forward fewer than stage 1 needs to reach its first backward: nothing can go on
    stuck = {0: [("F", 0), ("B", 0), ("F", 1), ("B", 1)], 1: [("F", 0), ("F", 1), ("B", 0), ("B", 1)]}
    with pytest.raises(P.ScheduleDeadlock, match="stage 0 waits at B0 for stage 1's B0") as caught:
        P.simulate_schedule(stuck, 2, 2)
    assert caught.value.waiting == {0: (("B", 0), ("B", 1, 0)), 1: (("F", 1), ("F", 0, 1))}
    with pytest.raises(TypeError, match="stage"):
        P.simulate_schedule({0: []}, 2, 2)


def test_split_layers():
    assert P.split_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B
    assert P.split_layers(4, 2) == [2, 2] and P.split_layers(5, 2) == [3, 2] and P.split_layers(3, 1) == [3]
    with pytest.raises(ValueError, match="num_stages"):
        P.split_layers(2, 3)


def test_pipeline_stages_compose_to_the_model():
    from labkit.model import TransformerLM, tiny_config

    torch.manual_seed(0)
    model = TransformerLM(tiny_config(16, num_layers=3))
    x = torch.randint(0, 16, (2, 8))
    h = x
    for s in range(3):
        h = P.PipelineStage(model, s, 3)(h)
    torch.testing.assert_close(h, model(x))
    with pytest.raises(ValueError, match="stage"):
        P.PipelineStage(model, 3, 3)


def test_plot_timeline():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = P.simulate_schedule("1f1b", 2, 3)
    ax = P.plot_timeline(events, title="t")
    assert len(ax.patches) == 12 and ax.get_title() == "t"
    plt.close(ax.figure)


# ----------------------------------------------------------------------------- ring attention, expert parallelism
@pytest.mark.parametrize("world", ["two", "four"])
def test_ring_attention_equals_full_attention(request, world):
    runs = _runs(request, world)
    for rank in runs:
        r = runs[rank]["ring_attention_check"]
        assert max(r["output"], r["q_grad"], r["k_grad"], r["v_grad"]) < TOL, r
        assert r["forward"]["send"]["calls"] == r["predicted"]["steps"]
        assert r["forward"]["send"]["bytes"] == r["predicted"]["bytes_sent"]
        assert r["backward"]["send"]["bytes"] == r["predicted"]["bytes_sent"]


@pytest.mark.parametrize("world", ["two", "four"])
def test_allgather_context_attention_equals_full_attention_and_zigzag_balances_the_work(request, world):
    runs = _runs(request, world)
    n = len(runs)
    for rank in runs:
        for layout in ("contiguous", "zigzag"):
            r = runs[rank]["context_parallel_check"][layout]
            assert max(r["output"], r["q_grad"], r["k_grad"], r["v_grad"]) < TOL, (layout, r)
            # one all-gather of K and V together; a ring all-gather sends N - 1 of the N shards
            assert r["forward"] == {"all_gather": {"calls": 1, "bytes": r["kv_bytes_per_rank"],
                                                   "sent": (n - 1) * r["kv_bytes_per_rank"]}}
        assert runs[rank]["context_parallel_check"]["zigzag"]["blocks"] == 2 * n + 1
        assert runs[rank]["context_parallel_check"]["contiguous"]["blocks"] == 4 * rank + 3
    # the blocks computed are the causal work of causal_attention_work, in chunk units
    chunk = 32 // (2 * n)
    for layout in ("contiguous", "zigzag"):
        blocks = [runs[r]["context_parallel_check"][layout]["blocks"] for r in sorted(runs)]
        assert sum(blocks) == 2 * n * (2 * n + 1) // 2
        work = P.causal_attention_work(32, n, layout)
        # a computed block of chunk x chunk scores minus the masked half of each diagonal block
        assert work == [b * chunk * chunk - 2 * chunk * (chunk - 1) // 2 for b in blocks]


def test_context_parallel_chunks_and_bad_arguments():
    assert P.context_parallel_chunks(4, "zigzag") == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert P.context_parallel_chunks(2, "contiguous") == [(0, 1), (2, 3)]
    for n in (2, 4):
        for layout in ("contiguous", "zigzag"):
            positions = P.context_parallel_positions(32, n, layout)
            size = 32 // (2 * n)
            assert positions == [[c * size + i for c in held for i in range(size)] for held in P.context_parallel_chunks(n, layout)]
    with pytest.raises(ValueError, match="layout"):
        P.context_parallel_chunks(4, "striped")
    with pytest.raises(ValueError, match="q, k, v"):
        P.allgather_context_attention(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8))
    with pytest.raises(ValueError, match="even"):
        P.allgather_context_attention(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))


def test_meter_sees_chapter_04s_all_to_all(two):
    for rank in two:
        r = two[rank]["expert_parallel_traffic"]
        assert r["meter"]["all_to_all"]["calls"] == 3  # counts, dispatch, combine
        assert r["meter"]["all_to_all"]["sent"] == r["exchange"]["total_sent"]


# ----------------------------------------------------------------------------- formulas
def test_collective_bytes_sent_and_tensor_parallel_comm():
    assert P.collective_bytes_sent("all_reduce", 1000, 4) == 1500
    assert P.collective_bytes_sent("reduce_scatter", 1000, 4) == 750
    assert P.collective_bytes_sent("all_gather", 250, 4) == 750
    comm = P.tensor_parallel_comm(2, 8, 32, 2, 4)
    assert comm["forward"] == {"all_reduce": {"calls": 2, "bytes": 4096, "sent": 4096.0}}
    sp = P.tensor_parallel_comm(2, 8, 32, 4, 4, sequence_parallel=True)
    assert sp["forward"]["all_gather"]["sent"] + sp["forward"]["reduce_scatter"]["sent"] == P.tensor_parallel_comm(2, 8, 32, 4, 4)["forward"]["all_reduce"]["sent"]
    assert P.tp_comm_bytes(1, 1024, 4096, 8, 2) == 4 * 2 * 7 / 8 * 1024 * 4096 * 2
    assert P.ring_attention_comm(1, 16, 2, 8, 4, 4)["bytes_sent"] == 3 * 2 * 2 * 4 * 8 * 4
    with pytest.raises(ValueError, match="op"):
        P.collective_bytes_sent("gather", 1, 2)
    with pytest.raises(ValueError, match="seq"):
        P.tensor_parallel_comm(1, 7, 8, 2, 4, sequence_parallel=True)


def test_tp_collectives_table():
    assert P.tp_collectives("column") == (None, "all_reduce")
    assert P.tp_collectives("row") == ("all_reduce", None)
    assert P.tp_collectives("column", True) == ("all_gather", "reduce_scatter")
    assert P.tp_collectives("row", True) == ("reduce_scatter", "all_gather")
    with pytest.raises(ValueError, match="layer"):
        P.tp_collectives("embedding")


def test_modules_need_a_process_group():
    from labkit.nn import Linear

    with pytest.raises(RuntimeError, match="process group"):
        P.ColumnParallelLinear.from_linear(Linear(4, 4))
    with pytest.raises(ValueError, match="q"):
        P.ring_attention(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))


# ----------------------------------------------------------------------------- interleaved and zero-bubble schedules
def _torch_order(p, m, rank, chunks, zero_bubble):
    """torch.distributed.pipelining's order for one rank (its ScheduleInterleaved1F1B and, with one chunk,
    ScheduleInterleavedZeroBubble), built by the same private helpers its schedules call, idle slots dropped."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "_get_1f1b_rank_ops"):
        pytest.skip("this torch builds its interleaved orders differently")
    warmup = schedules._get_warmup_ops(rank, chunks, p, p, m, multiply_factor=1 if zero_bubble else 2)
    steady = chunks * m - warmup
    forward_stage = lambda step: ((step // p) % chunks) * p + rank  # noqa: E731
    backward_stage = lambda step: (chunks - 1 - ((step - warmup) // p) % chunks) * p + rank  # noqa: E731
    ops = schedules._get_1f1b_rank_ops(chunks, p, warmup, steady, chunks * m - steady, rank, forward_stage, backward_stage,
                                       rank if zero_bubble else 0, enable_zero_bubble=zero_bubble)
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [(kind[a.computation_type.name], a.microbatch_index, a.stage_index // p) for a in ops if a is not None]


@pytest.mark.parametrize("p, m, chunks", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 2)])
def test_interleaved_schedule_is_torchs_and_its_bubble_is_p_minus_1_over_v_m(p, m, chunks):
    for s in range(p):
        order = P.interleaved_one_f_one_b_schedule(p, m, s, chunks)
        assert order == _torch_order(p, m, s, chunks, zero_bubble=False)
        assert sorted(order) == sorted((k, i, c) for k in "FB" for i in range(m) for c in range(chunks))
    events = P.simulate_schedule("interleaved-1f1b", p, m, chunks=chunks)
    bubble = P.measured_bubble(events)
    assert bubble == pytest.approx(P.interleaved_bubble_fraction(p, m, chunks), abs=1e-12)
    idle_over_compute = bubble / (1 - bubble)
    assert idle_over_compute == pytest.approx((p - 1) / (chunks * m))  # Narayanan et al.'s (p-1)/(v·m)
    # the same work as 1F1B: 3 units per micro-batch and stage, in passes chunks times shorter
    assert sum(e[3] - e[2] for e in events[0]) == pytest.approx(3 * m)
    assert min(e[3] - e[2] for e in events[0]) == pytest.approx(1 / chunks)
    if chunks > 1:
        assert bubble < P.bubble_fraction(p, m)
    with pytest.raises(ValueError, match="multiple of num_stages"):
        P.interleaved_one_f_one_b_schedule(p, p + 1, 0, chunks)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 6), (4, 4), (4, 8), (8, 16)])
@pytest.mark.parametrize("times", [(1, 1, 1), (1, 1.5, 0.5), (1, 1, 0.5), (2, 1.2, 0.8)])
def test_zero_bubble_schedule_is_torchs_and_idles_p_minus_1_times_tf_plus_tb_minus_tw(p, m, times):
    tf, tb, tw = times
    for s in range(p):
        order = P.zero_bubble_schedule(p, m, s)
        assert [(k, i, 0) for k, i in order] == _torch_order(p, m, s, 1, zero_bubble=True)
        assert sorted(order) == sorted((k, i) for k in "FBW" for i in range(m))
        held = most = 0
        for kind, _ in order:  # forwarded, weight gradient not yet computed
            held += {"F": 1, "B": 0, "W": -1}[kind]
            most = max(most, held)
        assert most == min(p, m)  # every stage holds what 1F1B's first stage holds
    events = P.simulate_schedule("zb-h1", p, m, forward_time=tf, backward_time=tb + tw, weight_grad_time=tw)
    makespan = max(e[3] for ev in events.values() for e in ev)
    assert makespan == pytest.approx(m * (tf + tb + tw) + (p - 1) * (tf + tb - tw))  # Qi et al. 2023, section 2.1
    assert P.measured_bubble(events) == pytest.approx(P.zero_bubble_fraction(p, m, tf, tb, tw))
    one_f_one_b = P.simulate_schedule("1f1b", p, m, forward_time=tf, backward_time=tb + tw)
    assert max(e[3] for ev in one_f_one_b.values() for e in ev) == pytest.approx((m + p - 1) * (tf + tb + tw))
    if (tf, tb, tw) == (1, 1, 1):
        assert P.zero_bubble_fraction(p, m) / (1 - P.zero_bubble_fraction(p, m)) == pytest.approx((p - 1) / (3 * m))


def test_simulate_schedule_times_stages_and_passes_and_refuses_bad_input():
    # one slow stage: every slot waits for it (p = 2, m = 2: F F on stage 0, then stage 1 at twice the time)
    events = P.simulate_schedule("gpipe", 2, 2, forward_time=[1, 2], backward_time=[2, 4])
    assert events[1] == [("F", 0, 1, 3), ("F", 1, 3, 5), ("B", 0, 5, 9), ("B", 1, 9, 13)]
    assert events[0][-1] == ("B", 1, 13, 15)
    slow = P.simulate_schedule("1f1b", 2, 2, pass_times={(1, "F", 0): 5.0})
    assert slow[1][0] == ("F", 0, 1, 6.0)
    assert P.simulate_schedule("interleaved-1f1b", 2, 2, chunks=2)[0][0] == ("F", 0, 0, 0.5, 0)
    with pytest.raises(ValueError, match="forward_time"):
        P.simulate_schedule("1f1b", 2, 2, forward_time=[1])
    with pytest.raises(ValueError, match="chunks"):
        P.simulate_schedule("1f1b", 2, 2, chunks=2)
    with pytest.raises(ValueError, match="weight_grad_time"):
        P.simulate_schedule("zb-h1", 2, 2, weight_grad_time=3.0)
    with pytest.raises(ValueError, match="action"):
        P.simulate_schedule({0: [("X", 0)], 1: []}, 2, 1)


def test_replay_never_idles_more_than_the_run_it_replays():
    # a "measured" run: 1F1B's ideal timeline with stage 1's passes slower and a message delay of 0.5 on every hop
    ideal = P.simulate_schedule("1f1b", 2, 4, forward_time=[1, 1.5], backward_time=[2, 3])
    delayed = {s: [(k, i, a + 0.5 * n, b + 0.5 * n) for n, (k, i, a, b) in enumerate(ev)] for s, ev in ideal.items()}
    assert P.replay_timeline(ideal) == ideal  # nothing between the passes: the replay is the run
    replay = P.replay_timeline(delayed)
    assert P.measured_bubble(replay) == pytest.approx(P.measured_bubble(ideal))
    assert P.measured_bubble(delayed) > P.measured_bubble(replay) > P.bubble_fraction(2, 4)
    with pytest.raises(ValueError, match="events_by_rank"):
        P.replay_timeline({1: []})


# ----------------------------------------------------------------------------- vocabulary-parallel cross-entropy
@pytest.mark.parametrize("world", ["two", "four"])
def test_vocab_parallel_cross_entropy_equals_torchs_and_sends_three_numbers_per_token(request, world):
    runs = _runs(request, world)
    n = len(runs)
    for rank in runs:
        r = runs[rank]["vocab_parallel_loss"]
        assert max(r["loss"], r["hidden_grad"], r["weight_grad"]) < 1e-5, (rank, r)
        per_token = r["tokens"] * 4  # one float32 per token and all-reduce
        assert r["forward"] == {"all_reduce": {"calls": 3, "bytes": 3 * per_token,
                                               "sent": pytest.approx(3 * 2 * (n - 1) / n * per_token)}}
        assert r["backward"]["all_reduce"]["calls"] == 1  # f before the head: the hidden states' gradient, not the logits'
        assert r["gather_logits_bytes"]["sent"] == (n - 1) * r["tokens"] * r["vocab"] // n * 4
    assert len({round(runs[rank]["vocab_parallel_loss"]["mean_loss"], 6) for rank in runs}) == 1


def test_vocab_parallel_cross_entropy_needs_matching_shapes():
    with pytest.raises(RuntimeError, match="process group"):
        P.vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))


# ----------------------------------------------------------------------------- context parallelism: who computes what
def test_causal_work_per_rank_contiguous_and_zigzag():
    for seq, n in [(16, 2), (32, 4), (64, 8), (48, 3)]:
        mask = torch.tril(torch.ones(seq, seq, dtype=torch.long))  # row t: the keys query t attends to
        for layout in ("contiguous", "zigzag"):
            positions = P.context_parallel_positions(seq, n, layout)
            assert sorted(t for p in positions for t in p) == list(range(seq))
            work = P.causal_attention_work(seq, n, layout)
            assert work == [int(mask[p].sum()) for p in positions]
            assert sum(work) == seq * (seq + 1) // 2
        contiguous, zigzag = P.causal_attention_work(seq, n), P.causal_attention_work(seq, n, "zigzag")
        c = seq // n
        assert contiguous == [c * r * c + c * (c + 1) // 2 for r in range(n)]
        assert len(set(zigzag)) == 1
    assert P.context_parallel_positions(8, 2, "zigzag") == [[0, 1, 6, 7], [2, 3, 4, 5]]
    with pytest.raises(ValueError, match="divisible by 8"):
        P.context_parallel_positions(12, 4, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        P.causal_attention_work(8, 2, "striped")


def test_peak_in_flight_counts_what_a_stage_holds():
    assert P.peak_in_flight(P.gpipe_schedule(4, 6, 0)) == 6
    assert [P.peak_in_flight(P.one_f_one_b_schedule(4, 6, s)) for s in range(4)] == [4, 3, 2, 1]
    assert [P.peak_in_flight(P.zero_bubble_schedule(4, 6, s)) for s in range(4)] == [4, 4, 4, 4]
    # interleaved, p = 4, v = 2: 2(p-1) + (v-1)p = 10 warm-up chunk forwards, one more before the first backward
    assert P.peak_in_flight(P.interleaved_one_f_one_b_schedule(4, 8, 0, 2), chunks=2) == 11 / 2
    assert P.peak_in_flight(P.simulate_schedule("1f1b", 4, 6)[0]) == 4  # events work too


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_mlp_drawing_has_no_overlapping_labels(world_size):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = P.draw_tensor_parallel_mlp(world_size)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    texts = [t for t in ax.texts if t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i, a in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            assert not a.overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
    # every label inside a block fits its block
    for patch in ax.patches:
        box = patch.get_window_extent(renderer)
        for text, extent in zip(texts, boxes):
            if box.contains(*extent.get_points().mean(axis=0)):
                assert box.x0 <= extent.x0 and extent.x1 <= box.x1, text.get_text()
    plt.close(fig)
