"""Tensor parallelism in measured profiles: the TP layer's fits per TP degree, and how the cost model
prices a TP unit with and without a fit of its degree (docs/PROFILING.md, "Tensor parallelism")."""

import json

import numpy as np
import pytest

from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.planner.costmodel.profile_fit import build_profile, tp_layer_fits
from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.model import model_preset

SMALL = model_preset("small")
TS = [64, 256, 1024, 2048, 4096]
LIN1 = [2e-3 + 6e-5 * T for T in TS]              # TP=1 layer
HEAD1 = [1e-3 + 2e-5 * T for T in TS]             # embedding + LM head + loss, TP=1
COMP2 = [1.5e-3 + 4.5e-5 * T for T in TS]         # TP=2 layer, compute alone: far from half of TP=1
COMM2 = {"none": lambda T: 4e-3 + 1e-5 * T,       # what each mode's collectives add
         "slicing": lambda T: 8e-3 + 5e-6 * T,
         "commfuse": lambda T: 6e-3 + 8e-6 * T}


def _raw(tp: bool = True) -> dict:
    raw = dict(model="small", dtype="fp32", world=2, nodes=1, attention_lengths=[64, 256, 1024, 2048],
               attention_s=[1e-3, 3e-3, 2e-2, 7e-2], linear_tokens=TS, linear_s=LIN1, head_s=HEAD1,
               p2p_bytes=[2**10, 2**14, 2**18, 2**22],
               p2p_s={"intra": [30e-6 + b / 4e9 for b in [2**10, 2**14, 2**18, 2**22]]},
               topology={"device": "cpu", "hostname": "test"})
    if tp:
        rows = {"compute": [[T, c] for T, c in zip(TS, COMP2)]}
        for m, f in COMM2.items():
            rows[m] = [[T, c + f(T)] for T, c in zip(TS, COMP2)]
        raw["tp_linear_s"] = {"2": rows}
    return raw


def _cm(prof, tp: int, mode: str = "none") -> CostModel:
    return CostModel(cluster_preset("local-cpu:1x2"), SMALL, prof, tp=tp, tp_overlap=mode)


def test_tp_fit_recorded_per_degree():
    prof, report = build_profile(_raw(), SMALL, cluster_name="local-cpu")
    f2 = prof.fits_for("small", "fp32", 2)
    assert f2 is not None and f2.tp == 2
    np.testing.assert_allclose(f2.linear.coeffs[:2], [1.5e-3, 4.5e-5], rtol=1e-6)
    assert set(f2.linear_tp_comm) == {"none", "slicing", "commfuse"}
    assert report["tp2_compute"]["worst"] < 1e-6 and report["tp2_commfuse"]["worst"] < 1e-6
    # the TP=1 fits stay where they were
    assert prof.fits[0].tp == 1 and prof.fits_for("small", "fp32", 1).linear.points[0] == [64.0, LIN1[0]]
    back = type(prof).model_validate_json(prof.model_dump_json())
    assert back.fits_for("small", "fp32", 2) == f2


@pytest.mark.parametrize("mode", ["none", "slicing", "commfuse"])
def test_cost_model_prices_a_tp_unit_from_its_measured_fit(mode):
    prof, _ = build_profile(_raw(), SMALL)
    cm = _cm(prof, 2, mode)
    T = np.array([100.0, 1500.0, 4096.0])
    np.testing.assert_allclose(cm.linear_time(T), 1.5e-3 + 4.5e-5 * T, rtol=1e-6)
    np.testing.assert_allclose(cm.tp_exposed_comm(T), COMM2[mode](T), rtol=1e-5)
    np.testing.assert_allclose(cm.tp_exposed_comm(T, "none"), COMM2["none"](T), rtol=1e-5)
    assert float(cm.tp_exposed_comm(0.0)) == 0.0 and float(cm.linear_time(0.0)) == 0.0
    # the head runs whole on each rank's sequence shard: the TP=1 head at T / 2 tokens
    np.testing.assert_allclose(cm.head_time(T), 1e-3 + 2e-5 * T / 2, rtol=1e-6)
    # TP=1 units of the same profile are priced as before
    np.testing.assert_allclose(_cm(prof, 1).linear_time(T), 2e-3 + 6e-5 * T, rtol=1e-6)


def test_tp_unit_without_a_fit_of_its_degree_gets_no_compute_gain():
    """A measured profile without a TP=2 fit: each rank is charged the whole TP=1 layer (an upper
    bound, no gain assumed from the split) plus the link model's TP communication, so a TP=2 unit
    is never cheaper per layer than a TP=1 unit holding the same tokens."""
    prof, _ = build_profile(_raw(tp=False), SMALL)
    assert prof.fits_for("small", "fp32", 2) is None
    cm2, cm1 = _cm(prof, 2), _cm(prof, 1)
    T = np.array([256.0, 2048.0, 8192.0])
    np.testing.assert_allclose(cm2.linear_time(T), cm1.linear_time(T), rtol=1e-12)
    comm, _ = cm2.tp_site_times(T)
    np.testing.assert_allclose(cm2.tp_exposed_comm(T), cm2.TP_SITES * comm)
    assert np.all(cm2.linear_time(T) + cm2.tp_exposed_comm(T) > cm1.linear_time(T))


def test_preset_profiles_keep_the_efficiency_curve_for_tp():
    """Presets have no fits: a TP unit's linear time is the TP=1 curve's FLOPs divided by the degree
    (golden plans are made with presets and do not move)."""
    cm2, cm1 = (CostModel(cluster_preset("h100"), model_preset("llama-7b"), tp=t) for t in (2, 1))
    T = 4096.0
    k = cm1.profile.linear
    expect = k.overhead_s + cm1.linear_flops_fwd(T) * 3.0 / 2 / (cm1.peak_flops * cm1._eff(k, T))
    assert float(cm2.linear_time(T)) == pytest.approx(float(expect), rel=1e-12)


def test_tp_layer_fits_need_three_compute_points():
    rows = {"compute": [[64, 1e-3], [256, 2e-3]], "none": [[64, 2e-3], [256, 3e-3], [1024, 5e-3]]}
    assert tp_layer_fits(2, rows, "small", "fp32") is None
    rows["compute"].append([1024, 4e-3])
    rows["slicing"] = [[64, 0.0]]             # too few usable points: left out
    f = tp_layer_fits(2, rows, "small", "fp32")
    assert f.tp == 2 and set(f.linear_tp_comm) == {"none"}


def test_profile_without_tp_fits_dumps_as_before():
    prof, _ = build_profile(_raw(tp=False), SMALL)
    d = json.loads(prof.model_dump_json())
    assert len(d["fits"]) == 1 and "linear_tp_comm" not in d["fits"][0]


def test_tp_degrees_inside_a_node():
    from zeppelin.runtime.profiler import tp_degrees

    assert tp_degrees(1, SMALL) == []
    assert tp_degrees(2, SMALL) == [2]
    assert tp_degrees(4, SMALL) == [2, 4]
    assert tp_degrees(8, model_preset("tiny")) == [2, 4]   # 4 query heads
