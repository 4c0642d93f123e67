"""Cost-model fitting on synthetic measurements, and the topology parser on nvidia-smi matrices.

The two topology files in tests/data follow the layout `nvidia-smi topo -m` prints on an 8-GPU
NVSwitch node with a current driver: a tab-separated matrix whose header row names GPU0..GPU7,
NIC0..NIC<n-1>, "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID" (GPU rows end with an empty cell
before the GPU NUMA ID, as nvidia-smi prints them), one row per GPU and per NIC, the connection
legend, and the "NIC Legend" mapping NIC<k> to its device name (mlx5_<k>). They were written for
these tests from that layout. Older drivers named the NIC columns after the devices and had no
NIC legend; that variant is tested inline.
"""

from pathlib import Path

import numpy as np
import pytest

from zeppelin.planner.costmodel.profile_fit import (
    fit_alpha_beta,
    fit_poly,
    infiniband_devices,
    parse_nvidia_smi_topo,
)

DATA = Path(__file__).resolve().parents[1] / "data"


def test_fit_recovers_known_quadratic():
    rng = np.random.default_rng(0)
    L = np.array([128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    c0, c1, c2 = 2e-4, 3e-7, 5e-11
    t = (c0 + c1 * L + c2 * L * L) * (1 + rng.normal(0, 0.002, L.size))
    rep = fit_poly(L, t)
    np.testing.assert_allclose(rep.coeffs, [c0, c1, c2], rtol=0.05)
    assert rep.median < 0.005 and rep.worst < 0.02
    assert len(rep.rel_errors) == L.size


def test_fit_exact_without_noise_and_nonnegative():
    L = np.array([100, 200, 400, 800])
    rep = fit_poly(L, 1e-3 + 2e-6 * L)          # no quadratic term
    np.testing.assert_allclose(rep.coeffs, [1e-3, 2e-6, 0.0], atol=1e-12)
    assert rep.worst < 1e-9
    rep = fit_poly(L, 5e-9 * L * L)              # pure quadratic: c0 and c1 must not go negative
    assert min(rep.coeffs) >= 0
    np.testing.assert_allclose(rep.coeffs[2], 5e-9, rtol=1e-9)


def test_fit_input_errors():
    with pytest.raises(ValueError, match="need at least 3 measurements for a degree-2 fit, got 2"):
        fit_poly([1, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="measured times must be positive"):
        fit_poly([1, 2, 3], [1.0, 0.0, 2.0])


def test_alpha_beta_recovered():
    b = np.array([1e3, 1e4, 1e5, 1e6, 1e7, 1e8])
    alpha, bw = 25e-6, 12.5  # GB/s
    link, rep = fit_alpha_beta(b, alpha + b / (bw * 1e9))
    assert link.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert link.bandwidth_GBps == pytest.approx(bw, rel=1e-6)
    with pytest.raises(ValueError, match="times do not grow with message size"):
        fit_alpha_beta(b, np.full(b.size, 1e-3))


def test_topology_4_nics():
    topo = parse_nvidia_smi_topo((DATA / "topo_nvswitch_4nic.txt").read_text())
    assert topo.num_gpus == 8 and topo.nvswitch
    assert topo.nvlinks[0][1] == 18 and topo.nvlinks[3][3] == 0
    assert topo.nics == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert topo.gpu_nic == ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1", "mlx5_2", "mlx5_2", "mlx5_3", "mlx5_3"]
    assert set(topo.gpu_nic_relation) == {"PXB"}


def test_topology_8_nics_with_legend():
    topo = parse_nvidia_smi_topo((DATA / "topo_nvswitch_8nic.txt").read_text())
    assert topo.num_gpus == 8 and topo.nvswitch
    assert topo.nics == [f"mlx5_{k}" for k in range(8)]
    assert topo.gpu_nic == topo.nics
    assert topo.gpu_nic_relation == ["PIX"] * 8


# an older driver's layout: NIC columns named after the devices, no NUMA columns, no NIC legend
OLD_STYLE = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tmlx5_0\tmlx5_1\tCPU Affinity\n"
    "GPU0\t X \tNV12\tNV12\tNV12\tPIX\tSYS\t0-23,48-71\n"
    "GPU1\tNV12\t X \tNV12\tNV12\tPIX\tSYS\t0-23,48-71\n"
    "GPU2\tNV12\tNV12\t X \tNV12\tSYS\tPIX\t24-47,72-95\n"
    "GPU3\tNV12\tNV12\tNV12\t X \tSYS\tPIX\t24-47,72-95\n"
    "mlx5_0\tPIX\tPIX\tSYS\tSYS\t X \tSYS\n"
    "mlx5_1\tSYS\tSYS\tPIX\tPIX\tSYS\t X \n"
    "\nLegend:\n\n  X    = Self\n"
)


def test_topology_old_style_device_columns():
    topo = parse_nvidia_smi_topo(OLD_STYLE)
    assert topo.num_gpus == 4 and topo.nvswitch and topo.nvlinks[2][0] == 12
    assert topo.nics == ["mlx5_0", "mlx5_1"]
    assert topo.gpu_nic == ["mlx5_0", "mlx5_0", "mlx5_1", "mlx5_1"]


def test_topology_garbage():
    from zeppelin.schemas.common import InputError

    with pytest.raises(InputError, match="no GPU matrix found"):
        parse_nvidia_smi_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")


def test_infiniband_sysfs(tmp_path):
    for dev, rate in (("mlx5_0", "400 Gb/sec (4X NDR)"), ("mlx5_1", "200 Gb/sec (4X HDR)")):
        p = tmp_path / dev / "ports" / "1"
        p.mkdir(parents=True)
        (p / "rate").write_text(rate + "\n")
    assert infiniband_devices(tmp_path) == {"mlx5_0": 50.0, "mlx5_1": 25.0}
    assert infiniband_devices(tmp_path / "none") == {}


def test_build_profile_from_synthetic_measurements():
    """Raw measurements generated from known coefficients are turned into a profile that reproduces them."""
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.planner.costmodel.profile_fit import build_profile
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset

    m = model_preset("small")
    Ls = [128, 256, 512, 1024, 2048, 4096]
    Ts = [128, 512, 1024, 2048, 4096, 8192]
    att = [1e-4 + 2e-8 * L + 3e-9 * L * L for L in Ls]
    lin = [5e-4 + 4e-6 * T for T in Ts]
    sizes = [2**10, 2**14, 2**18, 2**22]
    raw = dict(model="small", dtype="fp32", world=4, nodes=2, attention_lengths=Ls, attention_s=att,
               linear_tokens=Ts, linear_s=lin, p2p_bytes=sizes,
               p2p_s={"intra": [50e-6 + b / 2e9 for b in sizes], "inter": [200e-6 + b / 0.5e9 for b in sizes]},
               collectives_s={"alltoall": {"2": 2**22 / 2 / 2e9}}, collective_bytes=2**22,
               concurrent_inter_ratio=1.97, topology={"device": "cpu", "hostname": "test"})
    prof, report = build_profile(raw, m, cluster_name="local-cpu")
    assert prof.source.kind == "measured"
    np.testing.assert_allclose(prof.fits[0].attention.coeffs, [1e-4, 2e-8, 3e-9], rtol=1e-6)
    np.testing.assert_allclose(prof.fits[0].linear.coeffs[:2], [5e-4, 4e-6], rtol=1e-6)
    assert prof.intra.bandwidth_GBps == pytest.approx(2.0) and prof.intra.alpha_s == pytest.approx(50e-6)
    assert prof.inter.bandwidth_GBps == pytest.approx(0.5) and prof.inter.alpha_s == pytest.approx(200e-6)
    assert prof.alltoall_efficiency["2"] == pytest.approx(1.0)
    assert prof.nic_shared_by_concurrent_transfers is True
    assert report["attention"]["worst"] < 1e-6
    # the cost model uses the fits for the profiled model
    cm = CostModel(cluster_preset("local-cpu:2x2"), m, prof)
    np.testing.assert_allclose(cm.attn_time(1000), 1e-4 + 2e-5 + 3e-3)
    np.testing.assert_allclose(cm.linear_time(1000), 5e-4 + 4e-3, rtol=1e-6)
    np.testing.assert_allclose(cm.p2p_time(1e6, "inter"), 200e-6 + 1e6 / 0.5e9)


# ------------------------------------------------------------------ per-sequence attention cost


def test_attention_fit_keeps_the_per_sequence_cost_measured_from_packs():
    """The profiler times short sequences in packs of pack_count(L) and divides by the pack size.
    A runtime that pays a fixed cost per sequence (per call, fwd + bwd) on top of an L^2 kernel:
    the fitted constant is that cost, and the cost model prices a pack of K sequences as measured."""
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.planner.costmodel.profile_fit import build_profile
    from zeppelin.runtime.profiler import QUICK, pack_count
    from zeppelin.schemas.cluster import cluster_preset
    from zeppelin.schemas.model import model_preset

    per_seq, a = 1.8e-3, 6e-8              # a per-sequence cost that dwarfs the kernel of short sequences
    Ls = QUICK["att"]
    counts = [pack_count(L) for L in Ls]
    assert counts[0] > 1 and counts[-1] == 1  # short sequences are really packed
    pack_s = [K * (per_seq + a * L * L) for L, K in zip(Ls, counts)]
    raw = dict(model="small", dtype="fp32", world=2, nodes=1, attention_lengths=Ls,
               attention_s=[t / K for t, K in zip(pack_s, counts)], attention_pack_counts=counts,
               linear_tokens=[64, 256, 1024], linear_s=[1e-3, 3e-3, 1e-2], topology={"device": "cpu"})
    prof, report = build_profile(raw, model_preset("small"))
    fit = prof.fits[0].attention
    assert fit.coeffs[0] == pytest.approx(per_seq, rel=1e-6)
    assert fit.coeffs[2] == pytest.approx(a, rel=1e-6)
    assert report["attention"]["pack_counts"] == counts
    cm = CostModel(cluster_preset("local-cpu:1x2"), model_preset("small"), prof)
    # a rank with 64 sequences of 16 tokens pays 64 fixed costs, not one
    assert 64 * float(cm.attn_time(16)) == pytest.approx(64 * (per_seq + a * 256), rel=1e-6)
    assert 64 * float(cm.attn_time(16)) > 60 * per_seq


def test_ring_sync_recovered_from_synthetic_rings():
    """Rings measured with real and with short-circuited exchanges: the per-round exchange cost is
    recovered (median: robust to one noisy long ring), and the fits land in the profile."""
    from zeppelin.planner.costmodel.profile_fit import build_profile, ring_sync_per_round
    from zeppelin.schemas.model import model_preset

    Ls = [32, 64, 128, 256, 512, 1024, 2048]
    sync = {2: 2.5e-3, 4: 1.2e-3}
    ring = {}
    for G, s in sync.items():
        comp = [[L, 3e-4 + 4e-8 * L * L / G] for L in Ls if L >= 4 * G]
        tot = [[L, c + (G - 1) * s] for L, c in comp]
        tot[-1][1] = comp[-1][1] * 0.97           # the longest ring: noise hides the exchanges
        ring[str(G)] = {"total": tot, "compute": comp}
        assert ring_sync_per_round(G, tot, comp) == pytest.approx(s, rel=1e-9)
    assert ring_sync_per_round(2, [], []) is None
    raw = dict(model="small", dtype="fp32", world=4, nodes=1, attention_lengths=Ls,
               attention_s=[2e-4 + 5e-8 * L * L for L in Ls], linear_tokens=[64, 256, 1024],
               linear_s=[1e-3, 3e-3, 1e-2], ring_attention_s=ring, topology={"device": "cpu"})
    prof, report = build_profile(raw, model_preset("small"))
    f = prof.fits[0]
    assert f.ring_sync_s == pytest.approx({"2": 2.5e-3, "4": 1.2e-3}, rel=1e-9)
    assert set(f.ring_attention) == set(f.ring_compute) == {"2", "4"}
    assert f.ring_compute["4"].coeffs == pytest.approx([3e-4, 0.0, 1e-8], rel=1e-6)
    assert f.ring_compute["2"].points[0] == [32.0, pytest.approx(3e-4 + 4e-8 * 32 * 32 / 2)]
    assert report["ring_compute_2"]["worst"] < 1e-6
    assert report["ring_sync_s"] == pytest.approx({"2": 2.5e-3, "4": 1.2e-3}, rel=1e-9)


def test_profile_hash_unchanged_without_ring_fits():
    """The ring fields came after profiles were first written: a profile without them dumps (and
    hashes, as recorded in plans) exactly as before; with them it round-trips."""
    import json

    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.profile import CostProfile, ModelFits, PolyFit

    plain = CostProfile(fits=[ModelFits(model="small", dtype="fp32", attention=PolyFit(coeffs=[1e-4, 0, 1e-8]))])
    d = json.loads(plain.model_dump_json())["fits"][0]
    assert not {"ring_attention", "ring_compute", "ring_sync_s"} & set(d)
    assert content_hash(plain) == content_hash(CostProfile.model_validate_json(plain.model_dump_json()))
    rich = plain.model_copy(deep=True)
    rich.fits[0].ring_sync_s = {"2": 1e-3}
    rich.fits[0].ring_attention = {"2": PolyFit(coeffs=[1e-3, 0, 2e-8])}
    back = CostProfile.model_validate_json(rich.model_dump_json())
    assert back == rich and back.fits[0].ring_sync_s == {"2": 1e-3}
    assert content_hash(back) != content_hash(plain)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_profiler_times_packs_of_sequences_through_the_engine_path(one_rank_group, monkeypatch):
    """measure_attention runs pack_count(L) distinct sequences per timed call through the engine's
    local path — one forward and one backward kernel call per sequence — and reports the pack time
    per sequence. A clock that charges a fixed cost per kernel call shows it: per sequence, exactly
    two calls' worth, whatever the pack size."""
    import torch

    from zeppelin.runtime.attn import blocks
    from zeppelin.runtime.profiler import measure_attention, pack_count
    from zeppelin.schemas.model import model_preset

    seen: list[tuple[str, int]] = []
    fwd, bwd = blocks._kernel_fwd, blocks._kernel_bwd
    monkeypatch.setattr(blocks, "_kernel_fwd", lambda q, *a: seen.append(("f", q.shape[0])) or fwd(q, *a))
    monkeypatch.setattr(blocks, "_kernel_bwd", lambda d, q, *a: seen.append(("b", q.shape[0])) or bwd(d, q, *a))
    per_call = 1e-3

    class CallClock:  # "time" = kernel calls x per_call
        def sweep(self, fns, reps, warmup, sync=None):
            out = []
            for fn in fns:
                seen.clear()
                fn()
                out.append(len(seen) * per_call)
                calls.append(list(seen))
            return out

    calls: list[list[tuple[str, int]]] = []
    Ls = [16, 64, 512]
    per_seq, counts = measure_attention(model_preset("small"), Ls, torch.device("cpu"), CallClock(), 1, 0)
    assert counts == [pack_count(L) for L in Ls] == [64, 32, 4]
    assert per_seq == pytest.approx([2 * per_call] * 3)
    for L, K, seen_k in zip(Ls, counts, calls):
        assert seen_k.count(("f", L)) == K and seen_k.count(("b", L)) == K and len(seen_k) == 2 * K


def test_ring_group_sizes_cover_every_size_inside_a_node():
    from zeppelin.runtime.profiler import ring_group_sizes

    assert ring_group_sizes(1, 1) == []
    assert ring_group_sizes(4, 4) == [2, 3, 4]          # a planner forms rings of 3 of 4 ranks too
    assert ring_group_sizes(4, 2) == [2, 4]             # 2 nodes of 2: across nodes, powers of two
    assert ring_group_sizes(32, 8) == [2, 3, 4, 5, 6, 7, 8, 16, 32]


def test_remap_exchange_fit_from_synthetic_measurements():
    """The remap exchange's extra time per byte count: a line (robust to a negative slope, which
    small sizes' waits produce), in the profile's fits; a profile without it hashes as before."""
    from zeppelin.planner.costmodel.profile_fit import build_profile, remap_exchange_fit
    from zeppelin.schemas.model import model_preset

    pts = [[b, 3e-3 + 2e-10 * b] for b in (16384, 131072, 524288, 2097152)]
    assert remap_exchange_fit(pts) == pytest.approx([3e-3, 2e-10], rel=1e-6)
    assert remap_exchange_fit([[1e4, 4e-3], [1e5, 2e-3], [1e6, 3e-3]]) == [3e-3, 0.0]
    assert remap_exchange_fit([[1e4, 4e-3]]) is None and remap_exchange_fit(None) is None
    Ls = [32, 64, 128, 256]
    raw = dict(model="small", dtype="fp32", world=2, nodes=1, attention_lengths=Ls,
               attention_s=[2e-4 + 5e-8 * L * L for L in Ls], linear_tokens=[64, 256, 1024],
               linear_s=[1e-3, 3e-3, 1e-2], remap_exchange_s=pts, topology={"device": "cpu"})
    prof, report = build_profile(raw, model_preset("small"))
    assert prof.fits[0].remap_exchange == pytest.approx([3e-3, 2e-10], rel=1e-6)
    assert report["remap_exchange"]["seconds"] == pytest.approx(3e-3, rel=1e-6)
    del raw["remap_exchange_s"]
    assert "remap_exchange" not in build_profile(raw, model_preset("small"))[0].fits[0].model_dump()
