"""Fitting the cost model to measurements, and reading a node's topology.

* :func:`fit_poly` — least squares on *relative* error for ``t(n) = c0 + c1*n + c2*n^2`` (kernel
  times span orders of magnitude; an absolute fit would ignore the short sequences that matter most
  for tiering). Coefficients are constrained to be non-negative.
* :func:`fit_alpha_beta` — ``t(bytes) = alpha + bytes / bandwidth`` for a link class.
* :func:`parse_nvidia_smi_topo` — GPU count, NVLink and GPU->NIC affinity from ``nvidia-smi topo -m``.
* :func:`infiniband_devices` — NIC names and rates from ``/sys/class/infiniband``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zeppelin.schemas.common import InputError
from zeppelin.schemas.profile import LinkCost, PolyFit


@dataclass
class FitReport:
    coeffs: list[float]
    rel_errors: list[float]  # per point, (pred - meas) / meas

    @property
    def median(self) -> float:
        return float(np.median(np.abs(self.rel_errors))) if self.rel_errors else 0.0

    @property
    def worst(self) -> float:
        return float(np.max(np.abs(self.rel_errors))) if self.rel_errors else 0.0


def _nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set elimination (tiny problems: <= 3 unknowns)."""
    n = A.shape[1]
    best, best_res = None, np.inf
    for mask in range(1, 1 << n):
        cols = [i for i in range(n) if mask >> i & 1]
        sub = A[:, cols]
        scale = np.linalg.norm(sub, axis=0)
        scale[scale == 0] = 1.0
        x, *_ = np.linalg.lstsq(sub / scale, b, rcond=None)
        x = x / scale
        if np.any(x < -1e-15 * np.abs(x).max()):
            continue
        full = np.zeros(n)
        full[cols] = np.maximum(x, 0.0)
        res = float(np.sum((A @ full - b) ** 2))
        if best is None or res < best_res * (1 - 1e-9):
            best, best_res = full, res
    return best if best is not None else np.zeros(n)


def fit_poly(sizes, times, degree: int = 2) -> FitReport:
    """Fit t(n) = sum c_i n^i (i <= degree, c_i >= 0) minimising relative squared error."""
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.shape != t.shape or n.size < degree + 1:
        raise ValueError(f"need at least {degree + 1} measurements for a degree-{degree} fit, got {n.size}")
    if np.any(t <= 0):
        raise ValueError("measured times must be positive")
    A = np.stack([n**i for i in range(degree + 1)], axis=1) / t[:, None]
    c = _nnls(A, np.ones_like(t))
    pred = np.stack([n**i for i in range(degree + 1)], axis=1) @ c
    return FitReport(coeffs=[float(x) for x in c], rel_errors=[float(x) for x in (pred - t) / t])


def poly_fit_record(sizes, times, degree: int = 2, keep_points: bool = False) -> tuple[PolyFit, FitReport]:
    """The fit as a profile record; ``keep_points``: also keep the measurements themselves, which
    the cost model then interpolates (the polynomial shapes the extrapolation)."""
    rep = fit_poly(sizes, times, degree)
    pts = sorted([float(n), float(t)] for n, t in zip(sizes, times)) if keep_points else None
    fit = PolyFit(coeffs=rep.coeffs, valid_from=int(min(sizes)), valid_to=int(max(sizes)),
                  rel_error_median=rep.median, rel_error_max=rep.worst, points=pts)
    return fit, rep


def fit_alpha_beta(nbytes, times) -> tuple[LinkCost, FitReport]:
    """t = alpha + bytes / bandwidth (alpha, 1/bandwidth >= 0), relative-error least squares."""
    rep = fit_poly(nbytes, times, degree=1)
    alpha, inv_bw = rep.coeffs
    if inv_bw <= 0:
        raise ValueError("cannot fit a bandwidth: times do not grow with message size")
    return LinkCost(alpha_s=alpha, bandwidth_GBps=1.0 / inv_bw / 1e9), rep


# ------------------------------------------------------------------------------------ topology

_RANK = {"X": 0, "PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5}


@dataclass
class NodeTopology:
    num_gpus: int
    nvlinks: list[list[int]]        # bonded NVLink count between GPU pairs (0: none)
    nics: list[str]                 # NIC device names in column order
    gpu_nic: list[str]              # nearest NIC of each GPU
    gpu_nic_relation: list[str]     # PIX / PXB / PHB / NODE / SYS to that NIC

    @property
    def nvswitch(self) -> bool:
        n = self.num_gpus
        return n > 1 and all(self.nvlinks[i][j] > 0 for i in range(n) for j in range(n) if i != j)


def parse_nvidia_smi_topo(text: str, source: str = "nvidia-smi topo -m") -> NodeTopology:
    """Parse the matrix printed by ``nvidia-smi topo -m`` (both the old style with NIC device names
    as column headers and the newer ``NIC<k>`` columns with a "NIC Legend")."""
    lines = [ln.rstrip("\n") for ln in text.splitlines()]
    head_i = next((i for i, ln in enumerate(lines) if re.match(r"^\s+GPU0\b", ln)), None)
    if head_i is None:
        raise InputError("no GPU matrix found (expected a header line starting with GPU0)", source=source)
    cols = [c.strip() for c in lines[head_i].strip().split("\t") if c.strip()]
    cols = [c for c in cols if c not in ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")]
    gpu_cols = [c for c in cols if re.fullmatch(r"GPU\d+", c)]
    nic_cols = [c for c in cols if not re.fullmatch(r"GPU\d+", c)]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.M))
    nic_names = [legend.get(c, c) for c in nic_cols]
    rows: dict[str, list[str]] = {}
    for ln in lines[head_i + 1:]:
        if not ln.strip() or ln.startswith("Legend"):
            break
        parts = ln.split("\t")
        rows[parts[0].strip()] = [p.strip() for p in parts[1:1 + len(cols)]]
    n = len(gpu_cols)
    nv = [[0] * n for _ in range(n)]
    gpu_nic, rel = [], []
    for i, g in enumerate(gpu_cols):
        if g not in rows:
            raise InputError(f"row for {g} missing", source=source)
        cells = rows[g]
        for j in range(n):
            m = re.fullmatch(r"NV(\d+)", cells[j])
            nv[i][j] = int(m.group(1)) if m else 0
        if nic_cols:
            best = min(range(len(nic_cols)), key=lambda k: (_RANK.get(cells[n + k], 9), k))
            gpu_nic.append(nic_names[best])
            rel.append(cells[n + best])
    return NodeTopology(num_gpus=n, nvlinks=nv, nics=nic_names, gpu_nic=gpu_nic, gpu_nic_relation=rel)


def infiniband_devices(root: str | Path = "/sys/class/infiniband") -> dict[str, float]:
    """NIC name -> rate in GB/s from ``/sys/class/infiniband/<dev>/ports/*/rate`` ("400 Gb/sec (4X NDR)")."""
    out: dict[str, float] = {}
    root = Path(root)
    if not root.is_dir():
        return out
    for dev in sorted(root.iterdir()):
        best = 0.0
        for rate in dev.glob("ports/*/rate"):
            m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate.read_text())
            if m:
                best = max(best, float(m.group(1)) / 8.0)
        out[dev.name] = best
    return out


# ------------------------------------------------------------------------------------ profile


def _eff_curve(sizes, rates) -> tuple[float, float]:
    """Fit rate(n) = R * n / (n + n_half) via 1/rate = 1/R + (n_half/R) / n. Returns (R, n_half)."""
    n = np.asarray(sizes, dtype=np.float64)
    r = np.asarray(rates, dtype=np.float64)
    A = np.stack([np.ones_like(n), 1.0 / n], axis=1)
    (inv_r, slope), *_ = np.linalg.lstsq(A, 1.0 / r, rcond=None)
    if inv_r <= 0:  # rate still rising linearly at the largest size: take the best measured
        return float(r.max()), 0.0
    return float(1.0 / inv_r), float(max(slope / inv_r, 0.0))


def ring_sync_per_round(G: int, total, compute) -> float | None:
    """What a ring round's exchanges cost the runtime beyond the ring's compute, seconds: the
    median over lengths of ``(total - compute) / (G - 1)`` (``total``/``compute``: ``[[L, s], ...]``
    of the same ring with real and with short-circuited exchanges). The median, because at the
    largest lengths the two are long computations whose difference is mostly noise. None when
    no length was measured both ways."""
    comp = {int(L): s for L, s in compute}
    diffs = [max(s - comp[int(L)], 0.0) / (G - 1) for L, s in total if int(L) in comp and G > 1]
    return float(np.median(diffs)) if diffs else None


def remap_exchange_fit(points) -> list[float] | None:
    """``[seconds, seconds per byte]`` of one remap exchange from ``[[bytes, extra s], ...]``
    (:func:`zeppelin.runtime.profiler.measure_remap_exchange`): a least-squares line, its slope
    kept non-negative (at small sizes the waits dominate and the slope is mostly noise); None
    without two points."""
    pts = [(float(b), float(s)) for b, s in points or () if b > 0]
    if len(pts) < 2:
        return None
    x = np.array([b for b, _ in pts])
    y = np.array([s for _, s in pts])
    slope, icpt = np.polyfit(x, y, 1)
    if slope < 0:
        slope, icpt = 0.0, float(np.median(y))
    return [float(max(icpt, 0.0)), float(slope)]


def tp_layer_fits(G: int, rows: dict, model: str, dtype: str, report: dict | None = None):
    """The fits of one TP degree ``G`` from the profiler's TP-SP layer measurements (``rows``:
    ``{"compute": [[T, s]...], "<mode>": [[T, s]...]}``): ``linear`` from the compute alone,
    ``linear_tp_comm[mode]`` from the layer with that mode's real collectives. None without at
    least three compute points."""
    from zeppelin.schemas.profile import ModelFits

    def fit(part):
        pts = [(T, s) for T, s in rows.get(part, []) if s > 0]
        if len(pts) < 3:
            return None
        f, rep = poly_fit_record([T for T, _ in pts], [s for _, s in pts], 2, keep_points=True)
        if report is not None:
            report[f"tp{G}_{part}"] = _fit_entry(rep)
        return f

    lin = fit("compute")
    if lin is None:
        return None
    comm = {m: f for m in rows if m != "compute" for f in [fit(m)] if f is not None}
    return ModelFits(model=model, dtype=dtype, tp=G, linear=lin, linear_tp_comm=comm)


def _fit_entry(rep: FitReport) -> dict:
    """A fit's line of the profile report: coefficients and per-point relative errors."""
    return {"coeffs": rep.coeffs, "rel_errors": rep.rel_errors, "median": rep.median, "worst": rep.worst}


def _kernel_fits(raw: dict, report: dict):
    """The attention, linear and attention-block fits: ``(attention, linear, block or None)``."""
    att_fit, att_rep = poly_fit_record(raw["attention_lengths"], raw["attention_s"], 2, keep_points=True)
    lin_fit, lin_rep = poly_fit_record(raw["linear_tokens"], raw["linear_s"], 2, keep_points=True)
    report["attention"] = _fit_entry(att_rep)
    report["linear"] = _fit_entry(lin_rep)
    block_fit = None
    if raw.get("attention_block_s"):  # off-diagonal ring blocks, every key visible
        block_fit, block_rep = poly_fit_record(raw["attention_block_sizes"], raw["attention_block_s"], 2,
                                               keep_points=True)
        report["attention_block"] = _fit_entry(block_rep)
    if raw.get("attention_pack_counts"):  # short sequences were timed in packs (per-sequence times)
        report["attention"]["pack_counts"] = [int(x) for x in raw["attention_pack_counts"]]
    return att_fit, lin_fit, block_fit


def _ring_fits(raw: dict, report: dict) -> tuple[dict[str, dict[str, PolyFit]], dict[str, float]]:
    """Per ring size: the fits of the ring with real (``total``) and short-circuited (``compute``)
    exchanges, and the exchanges' cost per round beyond compute."""
    ring_fits: dict[str, dict[str, PolyFit]] = {"total": {}, "compute": {}}
    ring_sync: dict[str, float] = {}
    for G, rows in sorted((raw.get("ring_attention_s") or {}).items(), key=lambda kv: int(kv[0])):
        sync = ring_sync_per_round(int(G), rows.get("total", []), rows.get("compute", []))
        if sync is not None:
            ring_sync[str(G)] = sync
            report.setdefault("ring_sync_s", {})[str(G)] = sync
        for part in ("total", "compute"):
            pts = [(L, s) for L, s in rows.get(part, []) if s > 0]
            if len(pts) < 3:
                continue
            fit, rep = poly_fit_record([L for L, _ in pts], [s for _, s in pts], 2, keep_points=True)
            ring_fits[part][str(G)] = fit
            report[f"ring_{part}_{G}"] = _fit_entry(rep)
    return ring_fits, ring_sync


def _step_fits(raw: dict, model, report: dict):
    """What runs once per step or model: the TP degrees' layer fits, the head fit, the optimizer
    step and the gradient all-reduces: ``(tp fits, head or None, optimizer s, params, all-reduce)``."""
    tp_fits = []
    for G, rows in sorted((raw.get("tp_linear_s") or {}).items(), key=lambda kv: int(kv[0])):
        tp_fit = tp_layer_fits(int(G), rows, raw["model"], raw["dtype"], report)
        if tp_fit is not None:
            tp_fits.append(tp_fit)
    head_fit = None
    if raw.get("head_s"):  # embedding + final norm + LM head + loss, once per model
        head_fit, head_rep = poly_fit_record(raw.get("head_tokens") or raw["linear_tokens"], raw["head_s"], 2,
                                             keep_points=True)
        report["head"] = _fit_entry(head_rep)
    opt_s = raw.get("optimizer_s")
    nparams = raw.get("num_params") or model.num_params()
    if opt_s is not None:
        report["optimizer"] = dict(seconds=opt_s, params=nparams)
    ar = {str(k): float(v) for k, v in (raw.get("grad_allreduce_s") or {}).items() if v and v > 0}
    if ar:
        report["grad_allreduce"] = ar
    return tp_fits, head_fit, opt_s, nparams, ar


def _rate_curves(raw: dict, model, report: dict) -> tuple[float, float, float, float]:
    """Efficiency curves, so that models other than the profiled one can be planned too:
    ``(linear FLOP/s, its n_half, attention FLOP/s, its n_half)``."""
    from zeppelin.planner.costmodel.cost import CostModel
    from zeppelin.schemas.cluster import cluster_preset

    probe = CostModel(cluster_preset("local-cpu"), model)
    lin_flops = probe.linear_flops_fwd(raw["linear_tokens"]) * 3.0
    att_flops = probe.attn_flops_fwd(raw["attention_lengths"]) * 3.5
    R_lin, h_lin = _eff_curve(raw["linear_tokens"], lin_flops / np.asarray(raw["linear_s"]))
    R_att, h_att = _eff_curve(raw["attention_lengths"], att_flops / np.asarray(raw["attention_s"]))
    report["rates"] = dict(linear_flops=R_lin, linear_n_half=h_lin, attention_flops=R_att, attention_n_half=h_att)
    return R_lin, h_lin, R_att, h_att


def _link_fits(raw: dict, report: dict) -> tuple[dict[str, LinkCost], dict[str, float]]:
    """Per link class its alpha-beta fit, and the all-to-all efficiency per group size."""
    links = {}
    for cls, ts in (raw.get("p2p_s") or {}).items():
        try:
            lc, rep = fit_alpha_beta(raw["p2p_bytes"], ts)
        except ValueError as e:
            report[f"p2p_{cls}"] = dict(error=str(e))
            continue
        links[cls] = lc
        report[f"p2p_{cls}"] = dict(alpha_s=lc.alpha_s, bandwidth_GBps=lc.bandwidth_GBps,
                                    rel_errors=rep.rel_errors, median=rep.median, worst=rep.worst)
    if "inter" not in links and "intra" in links:
        links["inter"] = links["intra"]  # one node: no inter-node class to measure
    eff = {}
    nb = raw.get("collective_bytes", 0)
    gpn = raw["world"] // max(raw.get("nodes", 1), 1)
    for G, t in (raw.get("collectives_s") or {}).get("alltoall", {}).items():
        g = int(G)
        lk = links.get("intra" if g <= gpn else "inter")
        if lk and t > 0:
            achieved = nb * (g - 1) / g / t / 1e9
            eff[G] = float(min(1.0, achieved / lk.bandwidth_GBps))
    return links, eff


def _exchange_fits(raw: dict, report: dict):
    """The remap exchange's fit and what FSDP2 adds per micro-batch: ``(remap or None, fsdp)``."""
    remap_ex = remap_exchange_fit(raw.get("remap_exchange_s"))
    if remap_ex is not None:
        report["remap_exchange"] = {"seconds": remap_ex[0], "seconds_per_byte": remap_ex[1],
                                    "points": raw.get("remap_exchange_s")}
    fsdp_mb = {str(k): float(v) for k, v in (raw.get("fsdp_microbatch_s") or {}).items() if v is not None and v >= 0}
    if fsdp_mb:
        report["fsdp_microbatch_s"] = fsdp_mb
    return remap_ex, fsdp_mb


def build_profile(raw: dict, model, cluster_name: str = "") -> tuple["CostProfile", dict]:
    """Turn raw measurements from ``zeppelin.runtime.profiler`` into a fitted :class:`CostProfile`.

    Returns the profile and a report with every fit's per-point relative error.
    """
    import datetime as _dt
    import platform

    from zeppelin.schemas.profile import CostProfile, KernelEfficiency, ModelFits, ProfileSource

    report: dict = {}
    att_fit, lin_fit, block_fit = _kernel_fits(raw, report)
    ring_fits, ring_sync = _ring_fits(raw, report)
    tp_fits, head_fit, opt_s, nparams, ar = _step_fits(raw, model, report)
    R_lin, h_lin, R_att, h_att = _rate_curves(raw, model, report)
    links, eff = _link_fits(raw, report)
    remap_ex, fsdp_mb = _exchange_fits(raw, report)
    share = raw.get("concurrent_inter_ratio")
    topo = raw.get("topology", {})
    prof = CostProfile(
        source=ProfileSource(kind="measured", machine=f"{topo.get('hostname', platform.node())} "
                             f"({topo.get('device', '?')}, {raw['world']} ranks)",
                             created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             notes=f"zeppelin profile, model {raw['model']}, {raw.get('elapsed_s', 0):.0f} s"),
        cluster=cluster_name,
        peak_tflops=R_lin / 1e12,
        linear=KernelEfficiency(eff_max=1.0, n_half=h_lin, overhead_s=0.0),
        attention=KernelEfficiency(eff_max=float(min(1.0, R_att / R_lin)), n_half=h_att, overhead_s=0.0),
        intra=links.get("intra"),
        inter=links.get("inter"),
        alltoall_efficiency=eff,
        nic_shared_by_concurrent_transfers=bool(share is None or share > 1.5),
        memory_reserved_gb=0.5 if topo.get("device") == "cpu" else 4.0,
        optimizer_s_per_param=float(opt_s) / nparams if opt_s is not None and nparams else None,
        fits=[ModelFits(model=raw["model"], dtype=raw["dtype"], attention=att_fit, linear=lin_fit,
                        attention_block=block_fit, head=head_fit, optimizer_s=opt_s, grad_allreduce_s=ar,
                        ring_attention=ring_fits["total"], ring_compute=ring_fits["compute"],
                        ring_sync_s=ring_sync, remap_exchange=remap_ex, fsdp_microbatch_s=fsdp_mb,
                        activation_memory=dict(raw.get("activation_memory") or {})), *tp_fits],
    )
    return prof, report
