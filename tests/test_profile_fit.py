"""Cost-model fitting on synthetic measurements, and the topology parser on nvidia-smi matrices.

The two topology files in tests/data follow the exact layout `nvidia-smi topo -m` prints on an
8-GPU NVSwitch node (tab-separated matrix, legend; the 8-NIC file uses the newer NIC<k> columns
with a "NIC Legend"); they were written for these tests from that documented layout.
"""

from pathlib import Path

import numpy as np
import pytest

from zeppelin.planner.profile_fit import fit_alpha_beta, fit_poly, infiniband_devices, parse_nvidia_smi_topo

DATA = Path(__file__).parent / "data"


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
    assert topo.nics == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]
    assert topo.gpu_nic == topo.nics
    assert topo.gpu_nic_relation == ["PIX"] * 8


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
