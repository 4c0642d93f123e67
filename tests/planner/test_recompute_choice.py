"""Recomputation chosen per micro-batch: the plan format, the cost of each choice, and the planner's
``--recompute auto`` (which may trade one micro-batch with recomputation against two without)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.runtime.test_flexsp_hydraulis_tp_plans import tight_cluster
from tests.runtime.test_recompute_per_microbatch import mixed_step
from tests.runtime.test_runtime_dist import make_header
from zeppelin.planner.core.base import PlanContext, get_planner
from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.planner.costmodel.predict import predict_step
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.invariants import plan_problems
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import MicroBatch, Sequence, StepPlan, plan_text, read_plan, write_plan
from zeppelin.schemas.profile import ActivationMemory, ModelFits


def _header(recompute: str = "per-microbatch"):
    h = make_header(cluster_preset("local-cpu:1x4"), model_preset("small"), 1)
    return h.model_copy(update={"recompute": recompute})


def test_choices_round_trip_and_unset_ones_are_not_written(tmp_path):
    header = _header()
    step = mixed_step(header)
    text = plan_text(header, [step])
    assert '"recompute":"full:2"' in text and '"recompute":"none"' not in text.split("\n", 1)[1]
    write_plan(tmp_path / "p.jsonl", header, [step])
    h2, (s2,) = read_plan(tmp_path / "p.jsonl")
    assert h2.recompute == "per-microbatch"
    assert [mb.recompute for mb in s2.microbatches] == [None, "selective", "full", "full:2"]
    # a plan without choices keeps its bytes: no "recompute" key in any micro-batch
    plain = step.model_copy(update={"microbatches": [mb.model_copy(update={"recompute": None})
                                                     for mb in step.microbatches]})
    assert '"recompute"' not in plan_text(_header("none"), [plain])


@pytest.mark.parametrize("bad", ["full:0", "full:", "partial", "selective:2", "full:x"])
def test_an_unknown_choice_is_refused(bad):
    with pytest.raises(ValidationError):
        MicroBatch(queues=[[]], recompute=bad)


def test_choices_need_a_per_microbatch_header_and_fewer_layers_than_the_model():
    step = mixed_step(_header())
    assert plan_problems(_header(), step) == []
    assert plan_problems(_header("full"), step)[0] == (
        "coverage: step 0 microbatch 1: says recompute 'selective' but the plan's header says recompute 'full' "
        "for every micro-batch (per-microbatch lets each say its own)")
    step.microbatches[3].recompute = "full:4"
    assert plan_problems(_header(), step) == [
        "coverage: step 0 microbatch 3: recompute 'full:4' names 4 layers, the model has 4 (all of them: 'full')"]


def test_memory_and_time_of_each_choice():
    cm = CostModel(cluster_preset("zeppelin-a:2"), model_preset("llama-7b"), recompute="per-microbatch")
    b = {m: cm.recompute_bytes_per_token(m) for m in ("none", "selective", "full", "full:8", "full:16")}
    assert b["none"] > b["selective"] > b["full"] and b["none"] > b["full:8"] > b["full:16"] > b["full"]
    # full:k keeps k/L of the way from none to full (the forward's share; one layer recomputed)
    act = {m: cm.recompute_split(m)[0] for m in ("none", "full", "full:8")}
    assert act["full:8"] == pytest.approx(act["none"] - 8 / 32 * (act["none"] - act["full"]))
    assert cm.recompute_capacity("full") > cm.recompute_capacity("selective") > cm.recompute_capacity("none")
    assert cm.recompute_capacity(None) == cm.token_capacity == cm.recompute_capacity("none")
    x = {m: float(cm.recompute_extra_time(m, 1.0, 2.0)) for m in ("none", "selective", "full", "full:16")}
    bl, ba = cm.profile.backward_linear_factor, cm.profile.backward_attention_factor
    assert x["none"] == 0.0
    assert x["full"] == pytest.approx(1.0 / (1 + ba) + 2.0 / (1 + bl))
    assert x["full:16"] == pytest.approx(x["full"] / 2)
    assert 0 < x["selective"] < 2.0 / (1 + bl)


def test_a_profiled_time_factor_replaces_the_analytic_one():
    cl, md = cluster_preset("local-cpu:1x4"), model_preset("small")
    base = CostModel(cl, md)
    fits = ModelFits(model=md.name, dtype=md.dtype, activation_memory={
        "full": ActivationMemory(activations=1.0, recompute=1.0, time_factor=0.5)})
    prof = base.profile.model_copy(update={"fits": [fits]})
    cm = CostModel(cl, md, prof, recompute="per-microbatch")
    assert float(cm.recompute_extra_time("full", 1.0, 3.0)) == pytest.approx(2.0)
    assert float(cm.recompute_extra_time("full:2", 1.0, 3.0)) == pytest.approx(1.0)
    assert '"time_factor"' not in ActivationMemory(activations=1.0).model_dump_json()


def test_prediction_charges_each_micro_batch_its_choice():
    header = _header()
    step = mixed_step(header)
    ctx = PlanContext(header.cluster, header.model, header.profile, recompute="per-microbatch")
    with_choices = predict_step(ctx, step)
    plain = step.model_copy(update={"microbatches": [mb.model_copy(update={"recompute": None})
                                                     for mb in step.microbatches]})
    without = predict_step(ctx, plain)
    assert with_choices.step_time_s > without.step_time_s
    assert with_choices.lower_bound_s == without.lower_bound_s  # the bound is the work without recomputation
    assert max(with_choices.per_unit.memory_gb) == pytest.approx(max(without.per_unit.memory_gb))  # none's mb


def _auto_plan(lengths, memory_gb):
    """Planned by zeppelin under ``auto`` without its candidate families (the tp-replicas family would
    hold a sequence too long for the units on replicas of a larger TP degree instead)."""
    cl = tight_cluster(memory_gb)
    md = model_preset("small")
    ctx = PlanContext(cl, md, CostModel(cl, md).profile, recompute="auto")
    seqs = [Sequence(sample_id=i, length=n) for i, n in enumerate(lengths)]
    return ctx, get_planner("zeppelin", families="none").plan_step(ctx, 0, seqs)


def test_auto_plans_what_no_global_mode_without_recompute_can_and_every_micro_batch_fits():
    from zeppelin.planner.tools.validate import memory_problems

    cm = CostModel(tight_cluster(0.56), model_preset("small"))
    cap_none = cm.token_capacity
    lengths = [5 * cap_none] + [cap_none // 4] * 6  # the longest needs more than the 4 units hold without
    ctx, plan = _auto_plan(lengths, 0.56)
    assert any(mb.recompute for mb in plan.microbatches)
    for i, mb in enumerate(plan.microbatches):
        assert memory_problems(ctx, plan, i, mb) == []
    with pytest.raises(Exception, match="more than the whole cluster can hold"):
        get_planner("zeppelin", families="none").plan_step(PlanContext(ctx.cluster, ctx.model, ctx.profile, recompute="none"), 0,
                                          [Sequence(sample_id=i, length=n) for i, n in enumerate(lengths)])


def test_baselines_run_none_under_auto_and_the_header_says_each_planners_mode():
    hp = get_planner("zeppelin")
    assert hp.recompute_mode("auto") == "per-microbatch" and hp.recompute_mode("full") == "full"
    assert get_planner("te-cp").recompute_mode("auto") == "none"
    assert get_planner("flexsp").recompute_mode("selective") == "selective"


def test_a_step_that_fits_without_recompute_in_one_micro_batch_is_unchanged():
    cl, md = cluster_preset("local-cpu:1x4"), model_preset("small")
    seqs = [Sequence(sample_id=i, length=n) for i, n in enumerate([300, 200, 100, 50])]
    auto = get_planner("zeppelin").plan_step(PlanContext(cl, md, CostModel(cl, md).profile, recompute="auto"), 0, seqs)
    none = get_planner("zeppelin").plan_step(PlanContext(cl, md, CostModel(cl, md).profile), 0, seqs)
    assert isinstance(auto, StepPlan) and auto.model_dump_json() == none.model_dump_json()


def test_run_report_sets_each_choice_beside_its_prediction():
    from zeppelin.planner.sim.report import Predictor, recompute_summary, recompute_table

    header = _header()
    step = mixed_step(header)
    pred = Predictor(header)
    per_rank = [[{"recompute": mb.recompute or "none", "tokens": 192 - 7 * r, "activations": 1000 * (i + 1),
                  "recompute_bytes": 10, "forward_s": 0.01, "backward_s": 0.02}
                 for i, mb in enumerate(step.microbatches)] for r in range(4)]
    rows = recompute_summary(pred, {0: step}, [{"step": 0, "memory": {"microbatches": per_rank}}])
    by = {r["recompute"]: r for r in rows}
    assert sorted(by) == ["full", "full:2", "none", "selective"] and all(r["microbatches"] == 4 for r in rows)
    assert by["selective"]["measured_bytes"] == 4 * 2010
    cm = pred.cost
    want = sum((192 - 7 * r) * cm.recompute_bytes_per_token("full:2") for r in range(4))
    assert by["full:2"]["predicted_bytes"] == pytest.approx(want)
    assert by["full"]["predicted_s"] > by["none"]["predicted_s"] > 0  # full's micro-batch runs its forward again
    assert recompute_table(rows)[2].split()[:2] == ["none", "4"]


def test_profile_times_each_recompute_mode(tmp_path):
    """`zeppelin profile`'s full grid times each mode against none on the runtime's model (one process)."""
    import torch
    import torch.distributed as dist

    from zeppelin.runtime.profiler import Timer, measure_recompute_time

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        got = measure_recompute_time(model_preset("tiny"), torch.device("cpu"), Timer(torch.device("cpu")), 1, 0,
                                     tokens=64)
    finally:
        dist.destroy_process_group()
    assert sorted(got) == ["full", "selective"] and all(0 <= v <= 10 for v in got.values())
    # what the cost model reads back from a profile
    assert ActivationMemory(activations=1.0, time_factor=got["full"]).time_factor == got["full"]


def test_compare_says_which_mode_each_planner_ran_with():
    from zeppelin.planner.tools.compare import recompute_note

    stats = [{"planner": "zeppelin", "recompute": "per-microbatch"}, {"planner": "te-cp", "recompute": "none"},
             {"planner": "flexsp", "recompute": "none"}]
    assert recompute_note(stats) == "recompute: per micro-batch (zeppelin), none (te-cp, flexsp)"


def _made_under(mode_made: str, lengths):
    """A ``plan_one`` for :func:`recompute.plan_step` that plans under ``mode_made`` alone (zeppelin
    without families on 4 units of 0.56 GB) and cannot plan under any other mode."""
    from zeppelin.planner.core.base import PlanningError

    planner = get_planner("zeppelin", families="none")

    def plan_one(mctx, step, seqs):
        if mctx.recompute != mode_made:
            raise PlanningError(f"not {mode_made}")
        return planner._plan_step(mctx, step, seqs)

    cl, md = tight_cluster(0.56), model_preset("small")
    ctx = PlanContext(cl, md, CostModel(cl, md).profile, recompute="auto")
    return ctx, [Sequence(sample_id=i, length=n) for i, n in enumerate(lengths)], plan_one


def test_a_choice_per_micro_batch_never_loses_to_the_mode_its_plan_was_made_for():
    """Three sequences of 1.5x what a unit holds without recomputation: the plan made under
    ``selective`` is one micro-batch, for which the choice prices ``full:2`` faster. Kept where the
    judge agrees; where the judge rates the plan as made (every micro-batch ``selective``) faster,
    that one is the step's plan, its prediction under ``selective``."""
    from zeppelin.planner.zeppelin import recompute as recompute_mod

    cap = CostModel(tight_cluster(0.56), model_preset("small")).recompute_capacity("none")
    ctx, seqs, plan_one = _made_under("selective", [int(1.5 * cap)] * 3)
    chosen = recompute_mod.plan_step(ctx, 0, seqs, plan_one)
    assert [mb.recompute for mb in chosen.microbatches] == ["full:2"]

    def judge(p):  # rates the micro-batches in selective 10% faster than the prediction does
        return p.prediction.step_time_s * (0.9 if all(mb.recompute == "selective" for mb in p.microbatches) else 1.0)

    made = recompute_mod.plan_step(ctx, 0, seqs, plan_one, judge)
    assert [mb.recompute for mb in made.microbatches] == ["selective"]
    assert made.prediction.step_time_s == predict_step(ctx, made).step_time_s > chosen.prediction.step_time_s


def test_auto_judges_its_modes_as_select_judges_candidates():
    """By the simulator up to the cluster size where select confirms its best by it (32 units);
    by the prediction, the close ones confirmed by the simulator, up to 256 units; by the
    prediction alone beyond and under ``select=predict``."""
    from zeppelin.planner.core.inputs import resolve_cluster, resolve_model, resolve_profile
    from zeppelin.planner.sim.simulate import Simulator

    def ctx_of(cluster, tp):
        cl = resolve_cluster(cluster)
        return PlanContext(cl, resolve_model("llama-13b"), resolve_profile(None, cl), tp=tp, recompute="auto")

    zp = get_planner("zeppelin")
    score, confirm = zp._mode_judges(ctx_of("zeppelin-a:8", 2))
    assert ctx_of("zeppelin-a:8", 2).num_units == 32 and score is not None and confirm is None
    score, confirm = zp._mode_judges(ctx_of("zeppelin-a:32", 1))
    assert ctx_of("zeppelin-a:32", 1).num_units == 256 and score is None and confirm is not None
    assert zp._mode_judges(ctx_of("zeppelin-a:33", 1)) == (None, None)  # 264 units
    assert get_planner("zeppelin", select="predict")._mode_judges(ctx_of("zeppelin-a:2", 2)) == (None, None)
    ctx, seqs, plan_one = _made_under("selective", [300, 200])
    plan = plan_one(ctx.__class__(ctx.cluster, ctx.model, ctx.profile, recompute="selective"), 0, seqs)
    assert get_planner("zeppelin")._mode_judges(ctx)[0](plan) == Simulator(ctx).simulate_step(plan).step_time_s


def test_confirm_ranks_again_the_modes_predicted_close_to_the_best():
    """Three modes' plans predicted 1.00, 1.05 and 1.30: ``confirm`` times the first two only (the
    third is beyond the 10% margin) and its ranking decides, whatever the prediction said; two
    modes' identical plans are timed once and the earlier wins."""
    from types import SimpleNamespace

    from zeppelin.planner.zeppelin import recompute as recompute_mod

    def plan(t, k, choice=None):
        return SimpleNamespace(name=k, microbatches=[SimpleNamespace(queues=[0] * 4, recompute=choice, recompute_units=None, placements=[0] * k)])

    a, b, c = plan(1.0, 1, "full:2"), plan(1.05, 2), plan(1.3, 3)
    timed = []

    def confirm(p):
        timed.append(p.name)
        return {1: 2.0, 2: 1.5, 3: 0.1}[p.name]

    out = recompute_mod._confirmed([(1.0, a), (1.05, b), (1.3, c)], confirm)
    assert timed == [1, 2] and min(out, key=lambda tp: tp[0])[1] is b
    timed.clear()
    twin = plan(1.0, 1, "full:2")
    out = recompute_mod._confirmed([(1.0, a), (1.0, twin)], confirm)
    assert timed == [1] and [p for _, p in out] == [a]


def test_a_plan_is_not_kept_as_made_where_a_micro_batch_would_not_fit_so():
    """A plan handed in as made without recomputation whose units hold more than that allows (as a
    layout's extra copies can make them): its choice per micro-batch stays, however much faster the
    judge rates it without recomputation, and every micro-batch fits."""
    from zeppelin.planner.core.base import PlanningError
    from zeppelin.planner.tools.validate import memory_problems
    from zeppelin.planner.zeppelin import recompute as recompute_mod

    cap = CostModel(tight_cluster(0.56), model_preset("small")).recompute_capacity("none")
    ctx, seqs, _ = _made_under("selective", [int(1.5 * cap)] * 3)
    planner = get_planner("zeppelin", families="none")

    def plan_one(mctx, step, s):  # "made without recomputation", but under selective's capacity
        if mctx.recompute != "none":
            raise PlanningError("none only")
        return planner._plan_step(recompute_mod.mode_context(ctx, "selective"), step, s)

    def judge(p):
        return p.prediction.step_time_s * (0.5 if all(mb.recompute is None for mb in p.microbatches) else 1.0)

    plan = recompute_mod.plan_step(ctx, 0, seqs, plan_one, judge)
    assert [mb.recompute for mb in plan.microbatches] == ["full:2"]
    assert [memory_problems(ctx, plan, i, mb) for i, mb in enumerate(plan.microbatches)] == [[]]


def test_units_that_recompute_round_trip_and_are_checked(tmp_path):
    header = _header()
    step = mixed_step(header)
    step.microbatches[1].recompute_units = {"full:2": [0], "none": [2, 3]}
    write_plan(tmp_path / "p.jsonl", header, [step])
    _, (s2,) = read_plan(tmp_path / "p.jsonl")
    assert [mb.recompute_units for mb in s2.microbatches] == [None, {"full:2": [0], "none": [2, 3]}, None, None]
    assert [s2.microbatches[1].recompute_of(u) for u in range(4)] == ["full:2", "selective", "none", "none"]
    assert s2.microbatches[2].recompute_of(3) == "full" and s2.microbatches[0].recompute_of(0) is None
    assert plan_text(header, [step]).count('"recompute_units"') == 1  # written only where set
    for bad in ({"full:2": [2, 0]}, {"full:2": [1, 1]}, {"full:2": [4]}, {"full:2": [0], "none": [0]}):
        step.microbatches[1].recompute_units = bad
        assert plan_problems(header, step) == [
            "coverage: step 0 microbatch 1: recompute_units must list units of the micro-batch (0..3) in "
            "ascending order, each once"]
    step.microbatches[1].recompute_units = {"selective": [1]}
    assert plan_problems(header, step) == [
        "coverage: step 0 microbatch 1: recompute_units lists units for 'selective', the micro-batch's own choice"]
    step.microbatches[1].recompute_units = {"full:4": [1]}
    assert plan_problems(header, step) == [
        "coverage: step 0 microbatch 1: recompute 'full:4' names 4 layers, the model has 4 (all of them: 'full')"]
    step.microbatches[1].recompute_units = None
    plain = step.model_copy(update={"microbatches": [mb.model_copy(update={"recompute": None}) for mb in step.microbatches]})
    plain.microbatches[0].recompute_units = {"selective": [1]}
    assert plan_problems(_header("none"), plain) == [
        "coverage: step 0 microbatch 0: says recompute_units but the plan's header says recompute 'none' for "
        "every micro-batch (per-microbatch lets each say its own)"]
    with pytest.raises(ValidationError):
        MicroBatch(queues=[[]], recompute_units={"partial": [0]})


def test_only_the_units_that_need_it_recompute_and_only_they_pay():
    """A micro-batch in which one unit holds more than it may without recomputation: the choice
    runs on that unit alone, the prediction and the simulator charge its forward there only, and
    its memory is priced with the choice, the others' without."""
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.planner.tools.validate import memory_problems
    from zeppelin.planner.zeppelin.recompute import assign

    cl, md = tight_cluster(0.56), model_preset("small")
    ctx = PlanContext(cl, md, CostModel(cl, md).profile, recompute="per-microbatch")
    cap = ctx.cost.recompute_capacity("none")
    big = min(ctx.cost.recompute_capacity("selective"), int(cap * 1.2))
    lens = [big, cap // 2, cap // 2, cap // 3]
    header = make_header(cl, md, 1).model_copy(update={"recompute": "per-microbatch"})
    step = mixed_step(header, modes=("none",))
    step.sequences = [Sequence(sample_id=i, length=n) for i, n in enumerate(lens)]
    for u, p in enumerate(step.microbatches[0].placements):
        p.ranges = [[[0, lens[u]]]]
    assign(ctx, step)
    mb = step.microbatches[0]
    assert mb.recompute is None and list(mb.recompute_units.values()) == [[0]]  # (its cheapest choice)
    assert memory_problems(ctx, step, 0, mb) == []
    masked = step.prediction
    everyone = step.model_copy(deep=True)
    everyone.microbatches[0].recompute, everyone.microbatches[0].recompute_units = next(iter(mb.recompute_units)), None
    everyone.prediction = predict_step(ctx, everyone)
    plain = step.model_copy(deep=True)
    plain.microbatches[0].recompute, plain.microbatches[0].recompute_units = None, None
    plain.prediction = predict_step(ctx, plain)
    lin = [p.per_unit.linear_s for p in (masked, everyone.prediction, plain.prediction)]
    assert lin[0][0] == pytest.approx(lin[1][0]) and lin[0][0] > lin[2][0]  # unit 0 pays its forward again
    assert lin[0][1:] == pytest.approx(lin[2][1:]) and lin[1][1] > lin[2][1]  # the others do not
    mem = [p.per_unit.memory_gb for p in (masked, everyone.prediction, plain.prediction)]
    assert mem[0][0] == pytest.approx(mem[1][0]) and mem[0][1:] == pytest.approx(mem[2][1:])
    # the judge (the simulator, or the prediction) may rate another choice that fits faster: it wins
    from zeppelin.planner.zeppelin.recompute import _judged, fitting_choices

    other = next(m for m in fitting_choices(ctx, step, mb) if m not in ("none", *mb.recompute_units))
    judged, t = _judged(ctx, step.model_copy(deep=True), "none",
                        lambda p: float(p.microbatches[0].recompute_of(0) != other))
    assert (judged.microbatches[0].recompute, judged.microbatches[0].recompute_units, t) == (None, {other: [0]}, 0.0)
    sim = Simulator(ctx)
    busy = [[u.busy_s for u in sim.simulate_step(p).units] for p in (step, everyone, plain)]
    assert busy[0][0] == pytest.approx(busy[1][0]) and busy[0][0] > busy[2][0]
    assert busy[0][1:] == pytest.approx(busy[2][1:]) and busy[1][1] > busy[2][1]


def test_show_says_which_units_recompute():
    from zeppelin.planner.tools.show import recompute_lines

    step = mixed_step(_header())
    step.microbatches[1].recompute_units = {"full:2": [0, 1, 3]}
    step.microbatches[2].recompute_units = {"full:1": [1], "none": [2, 3]}
    assert recompute_lines(step) == [
        "recompute (micro-batch 1): full:2 on units 0-1,3 (3); selective on the other 1 of 4",
        "recompute (micro-batch 2): full:1 on unit 1; none on units 2-3 (2); full on the other 1 of 4",
        "recompute (micro-batch 3): full:2 on every unit"]


def test_judging_choices_computes_each_micro_batchs_terms_once_per_choice(monkeypatch):
    """``--recompute auto`` tries choices one micro-batch at a time (:class:`recompute.ChoicePredictor`):
    a step of two micro-batches computes each one's prediction terms once per choice it takes - not
    once per prediction for every micro-batch - and the plan it returns carries exactly the
    prediction ``predict_step`` makes of it, whichever choices the judge keeps."""
    from zeppelin.planner.zeppelin import recompute as recompute_mod

    cap = CostModel(tight_cluster(0.56), model_preset("small")).recompute_capacity("none")
    ctx, seqs, plan_one = _made_under("selective", [int(1.5 * cap)] * 6)
    real_terms, real_call = recompute_mod.microbatch_terms, recompute_mod.ChoicePredictor.__call__
    terms, predictions = [], []

    def counted_terms(c, lengths, mb, *a):
        terms.append((id(mb), mb.recompute, str(mb.recompute_units)))
        return real_terms(c, lengths, mb, *a)

    def counted_call(self):
        predictions.append(len(self.plan.microbatches))
        return real_call(self)

    monkeypatch.setattr(recompute_mod, "microbatch_terms", counted_terms)
    monkeypatch.setattr(recompute_mod.ChoicePredictor, "__call__", counted_call)
    for judge in (None, lambda p: p.prediction.step_time_s * (0.9 if p.microbatches[1].recompute == "selective" else 1)):
        terms.clear()
        predictions.clear()
        plan = recompute_mod.plan_step(ctx, 0, seqs, plan_one, judge)
        assert len(plan.microbatches) == 2
        assert plan.prediction == predict_step(ctx, plan)
        assert len(terms) == len(set(terms)) < sum(predictions)
    assert [mb.recompute for mb in plan.microbatches] == ["full:2", "selective"]
