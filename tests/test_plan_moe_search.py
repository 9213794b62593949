"""The planner's search for a mixture of experts: the MoE block's activation census against the
bytes the runtime saves, a rank's parameters and all-to-alls against hand counts, the all-to-all's
time from the cluster's links, the FLOPs per layer against the whole-model count, and `plan`
choosing (or not) expert parallelism with its reason."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from gridtrain.model.args import model_args
from gridtrain.model.llama import Transformer
from gridtrain.parallel.accounting import SavedActivations
from gridtrain.parallel.parallelize import apply_recompute
from gridtrain.plan import memory, placement, specs, steptime
from gridtrain.plan.activations import held_bytes
from gridtrain.plan.flops import hardware_flops_per_token
from gridtrain.plan.layout import Layout
from gridtrain.plan.moe_cost import all_to_all_payloads, ep_bytes_per_layer, moe_ffn_flops_per_token
from gridtrain.plan.shape import from_args

MIXTRAL = from_args(model_args("mixtral-8x7b"))
SMALL = dict(dim=64, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64)


def _saved(args, precision: str, recompute: str, tokens=(2, 16)) -> int:
    """Bytes one process saves for backward, measured by the runtime's saved-tensor hooks."""
    torch.manual_seed(0)
    model = Transformer(args).train()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if recompute != "none":
        apply_recompute(model, recompute)
    ids = torch.randint(0, args.vocab_size, tokens)
    with SavedActivations(model.parameters(), list(model.buffers())) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            out = model(ids)
        out.float().sum().backward()
    return meter.bytes


CASES = [  # (experts, top_k, expert ffn, shared, extra MoE keys)
    (4, 1, 32, 0, {"normalize_top_k": False, "balance": "none"}),
    (8, 2, 32, 0, {"z_loss_coef": 0.01, "balance": "aux_loss"}),
    (4, 2, 64, 1, {"grouped_mm": False, "balance": "bias"}),
    (4, 2, 32, 2, {"balance": "aux_loss", "score": "sigmoid", "normalize_top_k": True}),
    (8, 3, 32, 0, {"every": 2, "balance": "none"}),
]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_moe_census_equals_saved_bytes(precision, recompute):
    """An MoE block's census (activations.py) equals what the runtime saves, to the byte: the second
    block's bytes (two blocks less one), shared experts, the loop, every balance and score."""
    for experts, k, ffn, shared, extra in CASES:
        moe = dict(num_experts=experts, top_k=k, expert_ffn_dim=ffn, num_shared_experts=shared, z_loss_coef=0.0,
                   grouped_mm=True) | extra
        two, one = (model_args("tiny-moe", moe=moe, n_layers=n, **SMALL) for n in (2, 1))
        measured = _saved(two, precision, recompute) - _saved(one, precision, recompute)
        predicted = (held_bytes(from_args(two), {0: 1}, [2], 32, precision, recompute)
                     - held_bytes(from_args(one), {0: 1}, [1], 32, precision, recompute))
        assert measured == predicted, (experts, k, ffn, shared, extra)


def test_mixtral_rank_parameters_by_hand():
    """tp 2, pp 4, ep 8, a middle pipeline rank (8 blocks): per block the attention split by TP
    (2 x 4096 x 4096 / 2 + 2 x 4096 x 512), the norms (2 x 4096), the router (8 x 4096) and one
    of the 8 experts (3 x 4096 x 14336), whole."""
    layout = Layout(tp=2, pp=4, dp_replicate=8, ep=8)
    block = (2 * 4096 * 4096 // 2 + 2 * 4096 * 512) + 2 * 4096 + 8 * 4096 + 3 * 4096 * 14336
    assert memory.rank_params(MIXTRAL, layout, 1, 8) == 8 * block == 1_577_385_984
    assert memory.rank_expert_params(MIXTRAL, layout, 1) == 8 * 3 * 4096 * 14336
    # Without expert parallelism the rank holds all 8 experts of its blocks.
    whole = memory.rank_params(MIXTRAL, Layout(tp=2, pp=4, dp_replicate=8), 1, 8)
    assert whole - memory.rank_params(MIXTRAL, layout, 1, 8) == 8 * 7 * 3 * 4096 * 14336


def test_all_to_all_payloads_by_hand():
    """Mixtral, micro-batch 1 x 4096 tokens, ep 8: 8,192 assignments of 4,096 fp32 (dispatch, and
    its gradient) or bf16 (combine, and its gradient) values, the counts' 8 x 8 bytes first;
    selective recomputation runs the forward three again."""
    rows = 4096 * 2 * 4096
    layout = Layout(dp_replicate=8, ep=8, seq_len=4096)
    assert all_to_all_payloads(MIXTRAL, layout, 2) == [(64.0, False), (4.0 * rows, True), (2.0 * rows, True),
                                                      (2.0 * rows, True), (4.0 * rows, True)]
    again = all_to_all_payloads(MIXTRAL, Layout(dp_replicate=8, ep=8, seq_len=4096, recompute="selective"), 2)
    assert len(again) == 8 and again[5:] == again[:3]
    assert ep_bytes_per_layer(MIXTRAL, layout) == pytest.approx((64 + 12 * rows) * 7 / 8)
    assert all_to_all_payloads(MIXTRAL, Layout(dp_replicate=8, seq_len=4096), 2) == []


def test_all_to_all_time_by_hand():
    """64 ranks, 8 per node on DGX H100s: of 1 GB each rank sends, 7/64 crosses NVLink (450 GB/s x
    0.6) and 56/64 the NIC (50 GB/s x 0.8), at once: the NIC's 21.875 ms sets the pace, plus NCCL's
    base latency and one network step (8.4 + 14 us)."""
    cluster = specs.cluster("dgx-h100")
    levels = placement.axis_levels(cluster, 64, 1, 0.6, 0.8)
    assert placement.all_to_all_time(1e9, levels) == pytest.approx(56 / 64 / 40 + 8.4e-6 + 14e-6)
    inside = placement.axis_levels(cluster, 8, 1, 0.6, 0.8)
    assert placement.all_to_all_time(1e9, inside) == pytest.approx(7 / 8 / 270 + 8.4e-6 + 3.4e-6)


def test_layer_flops_add_up_to_the_model():
    """L MoE layers' FLOPs (attention part split by TP, the mixture whole on every TP rank) plus the
    head's give flops.hardware_flops_per_token, written independently, for every recompute mode
    where it counts the same work (none, full); one MoE feed-forward is 6 x (router + 2 experts)."""
    assert moe_ffn_flops_per_token(MIXTRAL, "none") == 6 * (8 * 4096 + 2 * 3 * 4096 * 14336)
    seq = 4096
    for mode in ("none", "full"):
        per_layer = (steptime.layer_attention_part_flops_per_token(MIXTRAL, seq, mode)
                     + moe_ffn_flops_per_token(MIXTRAL, mode))
        total = 32 * per_layer + steptime.edge_flops_per_token(MIXTRAL)
        assert total == pytest.approx(hardware_flops_per_token(MIXTRAL, seq, mode), rel=1e-12), mode


def test_tensor_parallelism_does_not_split_the_experts():
    """Doubling tp halves an MoE layer's attention matmuls but not its mixture's."""
    cluster = specs.cluster("dgx-h100")
    eff = steptime.CALIBRATED
    cost = {tp: steptime.layer_cost(MIXTRAL, cluster, eff, 4096, 1, tp, 1, tp > 1, "none", True, moe=True).matmul_s
            for tp in (1, 2)}
    peak = cluster.accelerator.peak_flops * eff.matmul
    mixture = moe_ffn_flops_per_token(MIXTRAL, "none") * 4096 / peak
    assert cost[2] - mixture == pytest.approx((cost[1] - mixture) / 2, rel=1e-9)


def _plan(*argv: str) -> tuple[int, str, str]:
    from gridtrain.plan.app.command import run_plan
    from gridtrain.plan.app.options import plan_parser

    args, extra = plan_parser().parse_known_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    return run_plan(args, extra, out, err), out.getvalue(), err.getvalue()


def test_plan_says_why_about_expert_parallelism():
    """Mixtral on 64 H100s: the plan names its expert-parallel degree and the step time of the best
    layout of the other kind; a fixed ep is planned as given; a broken ep relation is refused."""
    rc, out, _ = _plan("--model", "mixtral-8x7b", "--num-gpus", "64")
    assert rc == 0
    note = next(line for line in out.splitlines() if line.startswith("note: expert parallelism"))
    assert "s a step" in note and ("ep 1, because" in note or "beats the best layout without it" in note)
    rc, out, _ = _plan("--model", "mixtral-8x7b", "--num-gpus", "64", "--layout", "ep=8")
    assert rc == 0 and "EP all-to-alls (in line)" in out and "--parallel.ep 8" in out
    for layout, words in (("ep=3", "must divide the 8 experts"), ("ep=8,dp=2,cp=2", "must divide dp x cp (2 x 2 = 4)")):
        rc, _, err = _plan("--model", "mixtral-8x7b", "--num-gpus", "64", "--layout", layout)
        assert rc == 2 and words in err, err
    rc, _, err = _plan("--model", "llama3-8b", "--num-gpus", "8", "--layout", "ep=2")
    assert rc == 2 and "dense" in err
    # GPT blocks are dense: a mixture of experts is refused, not planned without its experts.
    rc, out, err = _plan("--model", "mixtral-8x7b", "--num-gpus", "64", "--arch", "gpt")
    assert rc == 2 and out == "" and "is a mixture of experts (8 experts, top 2): drop --arch gpt" in err, err


def test_step_bytes_under_expert_parallelism():
    """Mixtral, pp 8, cp 8 = ep 8, 128 micro-batches of 32,768 tokens: rank 0's 4 MoE layers each
    send 7/8 of (64 + 12 x 4,096 x 2 x 4,096) bytes per micro-batch; its FSDP traffic carries no
    expert (the same layout without EP moves 7 more experts' worth a block, 4 blocks)."""
    from gridtrain.plan import comm

    base = dict(pp=8, cp=8, zero_stage=2, seq_len=32768, num_microbatches=128)
    ep, plain = (comm.bytes_per_step(MIXTRAL, Layout(ep=e, **base)) for e in (8, 1))
    rows = 32768 // 8 * 2 * 4096
    assert ep["ep"] == pytest.approx(4 * 128 * (64 + 12 * rows) * 7 / 8)
    assert "ep" not in plain
    experts_per_rank = 4 * 8 * 3 * 4096 * 14336
    assert plain["dp_shard_cp"] > ep["dp_shard_cp"]
    ratio = (plain["dp_shard_cp"] - ep["dp_shard_cp"]) / ep["dp_shard_cp"]
    held = memory.rank_params(MIXTRAL, Layout(ep=8, **base), 0, 4) - memory.rank_expert_params(MIXTRAL, Layout(ep=8, **base), 0)
    assert ratio == pytest.approx(experts_per_rank / held, rel=1e-9)


def test_the_ep_note_says_what_the_chosen_layout_does_with_the_experts():
    """small-moe on 8 H100s plans plain DDP (zero 0, 8 replicas) at ep 1: no FSDP gathers the
    experts there, every replica holds them all and all-reduces their gradients; Mixtral on 64
    chooses ZeRO-2, whose FSDP gathers them."""
    for model, gpus, says in (("small-moe", "8", "every data-parallel rank holds all the experts"),
                              ("mixtral-8x7b", "64", "FSDP (ZeRO-2) gathers the experts")):
        rc, out, _ = _plan("--model", model, "--num-gpus", gpus)
        note = next(line for line in out.splitlines() if line.startswith("note: expert parallelism: ep 1"))
        assert rc == 0 and says in note, note


def test_an_ep_group_of_cp_and_dp_ranks_in_one_node_shares_its_nvlink():
    """ep 8 = cp 2 x dp 4 on one DGX H100 node: of 1 GB each rank sends, 1/8 stays and 7/8 crosses
    NVLink (450 GB/s x 0.6), the CP rank's share and the 6 DP ranks' on the same link: 7/8 / 270 s,
    plus NCCL's base latency and one NVLink step (8.4 + 3.4 us); as the same 8 ranks as one group."""
    from gridtrain.plan.moe_cost import ep_levels

    cluster = specs.cluster("dgx-h100")
    levels = ep_levels(cluster, Layout(cp=2, dp_shard=4, zero_stage=3, ep=8, seq_len=4096), 0.6, 0.8)
    assert [level.ranks for level in levels] == [2, 4]
    assert placement.all_to_all_time(1e9, levels) == pytest.approx(7 / 8 / 270 + 8.4e-6 + 3.4e-6)


def test_sequence_parallelism_adds_the_mixtures_gathers():
    """Under SP an MoE layer's TP traffic is the attention's (2 all-reduces, as without SP) plus the
    mixture's all-gathers, as dry runs of tiny-moe at tp 2 log them (per layer and micro-batch 2
    all-gathers and no reduce-scatter where a dense MLP has 2 of each; 1 more under recomputation):
    its input, fp32 (4 x 4,096 x 4,096 bytes for Mixtral's 4,096 tokens), and its output's bf16
    gradient (2 x 4,096 x 4,096)."""
    cluster = specs.cluster("dgx-h100")
    eff = steptime.CALIBRATED
    levels = placement.axis_levels(cluster, 2, 1, eff.intra_node, eff.inter_node)
    gather = {b: placement.all_gather_time(b * 4096 * 4096, levels) for b in (4, 2)}
    for recompute, fp32_gathers in (("none", 1), ("selective", 2), ("full", 2)):
        sp, plain = (steptime.layer_cost(MIXTRAL, cluster, eff, 4096, 1, 2, 1, s, recompute, True, moe=True).tp_s
                     for s in (True, False))
        assert sp - plain == pytest.approx(fp32_gathers * gather[4] + gather[2], rel=1e-12), recompute


def test_step_tp_bytes_of_a_mixture():
    """Mixtral on tp 2 (its 32 layers all MoE), one micro-batch of 4,096 tokens: per layer the
    attention's 2 ring all-reduces of 4,096 x 4,096 bf16 values, each sending 1/2 x 2 x 32 MiB,
    not a dense layer's 4; with SP 1/2 of the fp32 input's gather (64 MiB) and of the bf16
    gradient's (32 MiB) more; with full recomputation a third all-reduce and a second input gather."""
    from gridtrain.plan import comm

    mib = 2**20
    base = dict(tp=2, dp_shard=4, zero_stage=3, seq_len=4096, num_microbatches=1)
    assert comm.bytes_per_step(MIXTRAL, Layout(**base))["tp"] == 32 * 2 * 32 * mib
    assert comm.bytes_per_step(MIXTRAL, Layout(sequence_parallel=True, **base))["tp"] == 32 * (2 * 32 + 48) * mib
    full = Layout(sequence_parallel=True, recompute="full", **base)
    assert comm.bytes_per_step(MIXTRAL, full)["tp"] == 32 * (3 * 32 + 80) * mib


def test_mixtral_activations_off_the_census_and_its_working_block():
    """Per token of an MoE block of Mixtral in bf16 (h 4,096, kv 1,024, 32 heads, F_e 14,336, top 2
    of 8, renormalised): the mixture saves 2 x (6h + 8 F_e + 26 + 4) + 4 x 8 + 4 = 278,624 bytes.
    Full recomputation rematerializes one such block in backward: with the attention's census part
    (10h + 16h + 8 + 4h + 4 kv + 4 x 32 = 127,112) 405,736 bytes a token, not a dense block's
    (531,281.56 under EP 8, where the rank's experts receive the routed rows).
    Without fused attention (outside the census) each layer keeps 8h + 4h + 4 kv and the mixture
    (331,872) and the s x s scores (2 x 32 x 4,096 a token), 32 MoE layers of them."""
    base = dict(dp_shard=8, zero_stage=3, seq_len=4096, micro_batch=1, num_microbatches=1)
    full = Layout(recompute="full", **base)
    (_, _, acts), = memory.probe_activations(MIXTRAL, full, 2, (0,))
    assert acts - memory.census_activations(MIXTRAL, full, 0, 2) == 4096 * 405736
    # Under EP 8 each row the rank's experts receive adds an index and an h-wide bf16 row (2h + 8), and
    # the routed terms take the allowance measured at ep 8, 1.37x (bench/bench_moe_load.py):
    # 127,112 + 1.37 x 2 x (6h + 8 F_e + 30 + 2h + 8) + 36 = 531,281.56.
    spread = Layout(recompute="full", ep=8, **base)
    (_, _, acts), = memory.probe_activations(MIXTRAL, spread, 2, (0,))
    assert acts - memory.census_activations(MIXTRAL, spread, 0, 2) == pytest.approx(4096 * 531281.56, rel=1e-12)
    eager = Layout(flash_attention=False, **base)
    (_, _, acts), = memory.probe_activations(MIXTRAL, eager, 2, (0,))
    head = memory.head_activation_bytes(MIXTRAL, 4096, 1, act_bytes=2)
    assert acts - head == 32 * 4096 * (331872 + 2 * 32 * 4096)


def test_the_chosen_layout_line_keeps_ep():
    """'chosen layout: --layout ...' is the --layout syntax: under EP it names ep, and planning it
    again gives the same layout (without ep the search is free to drop expert parallelism)."""
    rc, out, _ = _plan("--model", "mixtral-8x7b", "--num-gpus", "64", "--layout", "ep=8")
    label = next(line for line in out.splitlines() if line.startswith("chosen layout: --layout ")).split()[-1]
    assert rc == 0 and label.endswith(",ep=8"), label
    rc, again, _ = _plan("--model", "mixtral-8x7b", "--num-gpus", "64", "--layout", label)
    assert rc == 0 and f"chosen layout: --layout {label}\n" in again


def test_selective_recomputation_reruns_the_grouped_experts_not_the_loops():
    """Selective recomputation saves matmul outputs, and the grouped matmul is not among them: with
    it Mixtral's 2 routed experts run forward again (2 x 2 x 3 x 4,096 x 14,336 FLOPs a token more);
    with the loop (model.moe.grouped_mm false) their matmuls are saved and nothing runs again."""
    from dataclasses import replace

    base = 6 * (8 * 4096 + 2 * 3 * 4096 * 14336)
    assert moe_ffn_flops_per_token(MIXTRAL, "selective") == base + 2 * 2 * 3 * 4096 * 14336
    assert moe_ffn_flops_per_token(replace(MIXTRAL, moe_grouped=False), "selective") == base


def test_the_ep_note_past_the_requests_time_says_so_and_keeps_the_plan():
    """The explorer gives a request a time budget; the ep note's comparison searches share it, and
    past it the note says the comparison ran out of time instead of failing the finished plan."""
    import time

    from gridtrain.plan.app.experts import ep_note
    from gridtrain.plan.search import Constraints, Problem, search
    from gridtrain.plan.stop import BUDGET, SearchBudget

    problem = Problem(MIXTRAL, specs.cluster("dgx-h100"), 64, 4096, 64)
    chosen = search(problem, Constraints(), top=1).ranked[0]
    assert "s a step" in ep_note(problem, Constraints(), chosen)
    past = time.monotonic() - 1
    token = BUDGET.set(SearchBudget(past, past))
    try:
        note = ep_note(problem, Constraints(), chosen)
    finally:
        BUDGET.reset(token)
    assert note.startswith(f"expert parallelism: ep {chosen.layout.ep};") and "ran out of this request's time" in note


def test_the_routing_allowance_is_the_busiest_ranks_rows_as_measured():
    """bench/bench_moe_load.py groups a run's routing as an ep group's micro-batch: ep micro-batches,
    each rank holding E / ep consecutive experts. Counts [3, 1, 1, 1, 1, 1, 1, 1] in each of four
    micro-batches (5 tokens at top-2): ep 2 ranks receive 12 and 8 rows (1.2x the mean), ep 4 ranks
    8, 4, 4, 4 (1.6x), ep 8 ranks 6 and seven 2s (2.4x). The planner's allowance is the aux-loss
    runs' figures at the measured ep, linear in log2(ep) between, held beyond, from the measured
    routing whose expert count is nearest the model's in log2 (the larger of two equally near)."""
    import importlib.util
    from pathlib import Path

    from gridtrain.plan.moe_cost import imbalance_tables, routing_imbalance

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_moe_load.py"
    spec = importlib.util.spec_from_file_location("bench_moe_load", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    counts = torch.tensor([3, 1, 1, 1, 1, 1, 1, 1]).repeat(8, 1, 1)  # (micro-batches, layers, E)
    for ep, expected in ((2, 1.2), (4, 1.6), (8, 2.4)):
        assert bench.rank_imbalance(counts, ep) == pytest.approx((expected, expected))
    assert bench.rank_imbalance(counts, 2, per_rank=2) == pytest.approx((1.2, 1.2))
    assert [routing_imbalance(ep, 8) for ep in (1, 2, 4, 8, 64)] == [1.0, 1.11, 1.20, 1.37, 1.37]
    assert routing_imbalance(3, 8) == pytest.approx(1.11 + 0.09 * 0.5849625, rel=1e-6)
    assert [routing_imbalance(ep, 32) for ep in (1, 2, 8, 32, 64)] == [1.0, 1.045, 1.162, 1.535, 1.535]
    assert [routing_imbalance(ep, 128) for ep in (2, 8, 64, 128)] == [1.031, 1.272, 2.040, 2.040]
    assert routing_imbalance(2, 2) == 1.11 and routing_imbalance(8, 256) == 1.272
    assert routing_imbalance(8, 0) == 1.0  # a dense model
    assert [imbalance_tables(e) for e in (2, 8, 15, 17, 32, 63, 65, 1024)] == \
        [[(8, 2)]] * 3 + [[(32, 8)]] * 3 + [[(128, 8)]] * 2
    assert imbalance_tables(16) == [(8, 2), (32, 8)] and imbalance_tables(64) == [(32, 8), (128, 8)]
    assert routing_imbalance(16, 16) == 1.401 and routing_imbalance(8, 16) == 1.37  # the larger at a tie
    assert routing_imbalance(64, 64) == 2.040 and routing_imbalance(2, 64) == 1.045


def test_a_capacity_factor_caps_the_busiest_ranks_rows_and_the_rows_sent():
    """Under capacity factor c a rank sends an expert at most ceil(c N k / E) of its N k assignments,
    so an ep rank holding E / ep experts receives at most c N k rows (c x the mean) and sends at
    most min(1, c) N k: Mixtral at ep 8, costed at 1.37x the mean dropless, is capped at 1.25x
    with c = 1.25, and at c = 0.5 its busiest rank runs half the mean and sends half the rows."""
    from gridtrain.plan.moe_cost import busiest_rows, ep_seconds

    layout = Layout(dp_replicate=8, ep=8, seq_len=4096)
    capped = {c: dataclasses.replace(MIXTRAL, capacity_factor=c) for c in (1.25, 0.5, 4.0)}
    assert busiest_rows(MIXTRAL, 8) == 1.37 and busiest_rows(capped[4.0], 8) == 1.37
    assert busiest_rows(capped[1.25], 8) == 1.25 and busiest_rows(capped[0.5], 8) == 0.5
    assert busiest_rows(capped[0.5], 1) == 0.5 and busiest_rows(capped[1.25], 1) == 1.0
    rows = 4096 * 2 * 4096
    assert ep_bytes_per_layer(capped[0.5], layout) == pytest.approx((64 + 12 * rows * 0.5) * 7 / 8)
    assert ep_bytes_per_layer(capped[1.25], layout) == ep_bytes_per_layer(MIXTRAL, layout)
    cluster = specs.cluster("dgx-h100")
    slow = [ep_seconds(shape, layout, cluster, 0.6, 0.8) for shape in (MIXTRAL, capped[1.25])]
    levels = placement.axis_levels(cluster, 8, 1, 0.6, 0.8)
    by_hand = [sum(placement.all_to_all_time(size * (f if carries else 1.0), levels)
                   for size, carries in all_to_all_payloads(MIXTRAL, layout, 2)) for f in (1.37, 1.25)]
    assert slow == pytest.approx(by_hand)
    flops = [moe_ffn_flops_per_token(shape, "none", busiest_rows(shape, 8)) for shape in (MIXTRAL, capped[1.25])]
    routed = 6 * 3 * 2 * 4096 * 14336
    assert flops[0] - flops[1] == pytest.approx(routed * (1.37 - 1.25))
    assert from_args(dataclasses.replace(model_args("tiny-moe"), moe=dataclasses.replace(
        model_args("tiny-moe").moe, capacity_factor=1.5))).capacity_factor == 1.5
