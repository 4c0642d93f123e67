"""The cost model against values derived by hand in this file."""

import numpy as np
import pytest

from zeppelin.planner.costmodel.cost import CostModel
from zeppelin.schemas.cluster import ClusterSpec, GPUSpec, LinkSpec, NICSpec, cluster_preset
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.profile import CostProfile, KernelEfficiency, LinkCost


def ideal_profile(**kw) -> CostProfile:
    """Every kernel at 100% of peak, no overheads: times follow FLOPs exactly."""
    return CostProfile(linear=KernelEfficiency(eff_max=1.0, n_half=0.0, overhead_s=0.0),
                       attention=KernelEfficiency(eff_max=1.0, n_half=0.0, overhead_s=0.0),
                       memory_reserved_gb=0.0, **kw)


def round_cluster(nodes=2, gpn=2) -> ClusterSpec:
    # 1 TFLOP/s, 10 GB memory, intra 10 GB/s no latency, one 1 GB/s NIC per node, 1 ms latency
    return ClusterSpec(name="round", num_nodes=nodes, gpus_per_node=gpn,
                       gpu=GPUSpec(name="g", peak_tflops=1.0, memory_gb=10.0),
                       intra_link=LinkSpec(bandwidth_GBps=10.0, latency_us=0.0),
                       nics=[NICSpec(id="n0", bandwidth_GBps=1.0, latency_us=1000.0)], gpu_nic=["n0"] * gpn)


TINY = model_preset("tiny")  # h=64, 4 heads, 2 KV heads (d=16), ffn 176, SwiGLU, fp32, 2 layers, vocab 256


def test_linear_flops_by_hand():
    c = CostModel(round_cluster(), TINY, ideal_profile())
    # q: 64*64, k and v: 64*32 each, o: 64*64, SwiGLU: 3*64*176; 2 FLOPs per multiply-add
    per_token = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 176)
    assert per_token == 92160
    assert c.linear_flops_per_token == per_token
    np.testing.assert_allclose(c.linear_flops_fwd([1, 10, 1000]), [92160, 921600, 92160000])


def test_gelu_mlp_flops():
    m = model_preset("gpt-7b")
    c = CostModel(cluster_preset("h100"), m)
    h = 4096
    assert c.linear_flops_per_token == 2 * (h * h * 3 + h * h + 2 * h * 4 * h)


def test_attention_flops_by_hand():
    c = CostModel(round_cluster(), TINY, ideal_profile())
    # causal: QK^T is 2*L*L*h FLOPs for the full square, PV the same; half is masked -> 2*L^2*h
    np.testing.assert_allclose(c.attn_flops_fwd([100, 1000]), [2 * 100**2 * 64, 2 * 1000**2 * 64])
    # a full (unmasked) 10 x 20 block: 4*lq*lk*h; a causal diagonal block half of that
    assert float(c.attn_block_flops_fwd(10, 20)) == 4 * 10 * 20 * 64
    assert float(c.attn_block_flops_fwd(10, 10, causal=True)) == 2 * 10 * 10 * 64


def test_times_at_ideal_efficiency():
    c = CostModel(round_cluster(), TINY, ideal_profile())
    # fwd + 2x bwd for linear, fwd + 2.5x bwd for attention, at 1e12 FLOP/s
    np.testing.assert_allclose(c.linear_time(1000), 3 * 92160 * 1000 / 1e12)
    np.testing.assert_allclose(c.attn_time(1000), 3.5 * 2 * 1000**2 * 64 / 1e12)
    head = 3 * 2 * 1000 * 64 * 256 / 1e12
    np.testing.assert_allclose(c.head_time(1000), head)
    np.testing.assert_allclose(c.seq_compute_time(1000), 2 * (3.5 * 2e6 * 64 + 3 * 92160e3) / 1e12 + head)
    assert float(c.attn_time(0)) == 0.0 and float(c.linear_time(0)) == 0.0


def test_efficiency_curve_and_overhead():
    prof = CostProfile(linear=KernelEfficiency(eff_max=0.5, n_half=100.0, overhead_s=1e-3))
    c = CostModel(round_cluster(), TINY, prof)
    # eff(100) = 0.5 * 100 / 200 = 0.25
    np.testing.assert_allclose(c.linear_time(100), 1e-3 + 3 * 92160 * 100 / (1e12 * 0.25))


def test_vectorised_over_lengths():
    c = CostModel(cluster_preset("zeppelin-a"), model_preset("llama-7b"))
    L = np.array([128, 1024, 8192, 65536])
    t = c.seq_compute_time(L)
    assert t.shape == (4,)
    np.testing.assert_allclose(t, [float(c.seq_compute_time(x)) for x in L])
    assert np.all(np.diff(t) > 0)
    # attention grows quadratically: 8x length -> ~64x attention FLOPs
    np.testing.assert_allclose(c.attn_flops_fwd(8192) / c.attn_flops_fwd(1024), 64.0)


def test_comm_alpha_beta():
    c = CostModel(round_cluster(), TINY, ideal_profile())
    np.testing.assert_allclose(c.p2p_time(1e9, "intra"), 0.1)           # 1 GB over 10 GB/s
    np.testing.assert_allclose(c.p2p_time(1e9, "inter"), 1.0 + 1e-3)   # 1 GB over 1 GB/s + 1 ms
    np.testing.assert_allclose(c.p2p_time(1e9, "inter", sharers=2), 2.0 + 1e-3)  # NIC shared by two
    assert float(c.p2p_time(0, "inter")) == 0.0
    # measured profile overrides the cluster's nominal links
    c2 = CostModel(round_cluster(), TINY, ideal_profile(inter=LinkCost(alpha_s=0.0, bandwidth_GBps=0.5)))
    np.testing.assert_allclose(c2.p2p_time(1e9, "inter"), 2.0)


def test_ring_attention_by_hand():
    c = CostModel(round_cluster(), TINY, ideal_profile())
    L, G = 400, 2
    comp_total = 3.5 * 2 * L * L * 64 / 1e12          # whole-sequence attention fwd+bwd
    comp_round = comp_total / G / G
    kv = (L / G) * 2 * 32 * 4                          # K and V of the 200 held tokens, fp32, 2 KV heads x 16
    comm_round = 3 * kv / 10e9                         # K,V fwd + K,V,dK,dV bwd over 10 GB/s
    expect = comp_round + (G - 1) * max(comp_round, comm_round)
    np.testing.assert_allclose(c.ring_attention_time(L, G, "intra"), expect)
    np.testing.assert_allclose(c.ring_exposed_comm(L, G, "intra"), max(comm_round - comp_round, 0.0))
    # inter-node: 1 GB/s NIC + 1 ms per message: communication exposed
    comm_inter = 1e-3 + 3 * kv / 1e9
    np.testing.assert_allclose(c.ring_exposed_comm(L, G, "inter"), comm_inter - comp_round)
    np.testing.assert_allclose(c.ring_attention_time(L, 1), c.attn_time(L))


def test_ulysses_and_allgather_by_hand():
    c = CostModel(round_cluster(), TINY, ideal_profile())
    T, G = 1000, 2
    per = T * (2 * 64 + 2 * 32) * 4                    # Q, O (hidden) and K, V (kv dim), fp32
    a2a = per * (G - 1) / G / 10e9
    np.testing.assert_allclose(c.ulysses_comm_time(T, G), 2 * a2a)
    ag = T * 2 * 32 * 4 * (G - 1) / 10e9
    np.testing.assert_allclose(c.allgather_kv_time(T, G), 3 * ag)
    assert float(c.ulysses_comm_time(T, 1)) == 0.0


def test_inter_node_all_to_all_by_hand():
    """A group over several nodes: the same-node shares go over the intra-node link, the rest
    through the node's NIC, which every GPU of the node on that NIC uses at once."""
    c = CostModel(round_cluster(nodes=3, gpn=2), TINY, ideal_profile())
    b = 6000.0
    # 4 units on 2 nodes: each unit sends 1/4 of b to its node mate (10 GB/s) and 2/4 through
    # the NIC it shares with its mate (1 GB/s, 1 ms per message, 3 messages)
    t_in = b * 1 / 4 / 10e9
    t_x = b * 2 / 4 * 2 / 1e9
    np.testing.assert_allclose(c.alltoall_time(b, 4, "inter"), 1e-3 * 3 + max(t_in, t_x))
    # 3 units over 2 nodes (2 + 1): the lone unit sends 2/3 of b across, alone on its NIC
    np.testing.assert_allclose(c.alltoall_time(b, 3, "inter"), 1e-3 * 2 + b * 2 / 3 / 1e9)
    # inside one node, or on the intra-node link: every share over the one link
    np.testing.assert_allclose(c.alltoall_time(b, 2, "inter"), 1e-3 + b / 2 / 1e9)
    np.testing.assert_allclose(c.alltoall_time(b, 4, "intra"), b * 3 / 4 / 10e9)
    # one NIC per GPU (cluster C): only the other node's shares cross, each GPU on its own NIC
    cc = CostModel(cluster_preset("zeppelin-c"), model_preset("llama-7b"), ideal_profile())
    lx, li = cc.inter_link, cc.intra_link
    expect = max(lx.alpha_s, li.alpha_s) * 15 + max(b * 7 / 16 / (li.bandwidth_GBps * 1e9),
                                                     b * 8 / 16 / (lx.bandwidth_GBps * 1e9))
    np.testing.assert_allclose(cc.alltoall_time(b, 16, "inter"), expect)


def test_memory_by_zero_stage():
    m = TINY  # fp32: c = 4
    P = m.num_params()
    block = m.params_per_layer()
    root = P - m.num_layers * block
    out = m.vocab_size * m.hidden + m.hidden   # LM head + final norm: gradients from the start of the backward
    # what the runtime's FSDP2 holds (fp32: weights 4, grads 4, Adam moments 8 bytes per parameter);
    # ZeRO-1 runs with ZeRO-2's holdings (FSDP reduce-scatters gradients as they are produced)
    # and is charged exactly those, not the classic split 8P + 8P/N
    shards = {"params": 4 * P / 4, "grads": 4 * P / 4, "optimizer": 8 * P / 4}
    for z, unsharded in ((1, 4 * P + 4 * (out + block)), (2, 4 * P + 4 * (out + block)),
                         (3, 4 * (root + 2 * block) + 4 * (out + block))):
        c = CostModel(round_cluster(), m, ideal_profile(), zero_stage=z)
        assert c.num_units == 4
        got = c.model_state_components()
        for k, v in shards.items():
            np.testing.assert_allclose(got[k], v)
        np.testing.assert_allclose(got["unsharded"], unsharded)
        np.testing.assert_allclose(c.model_state_bytes(), 16 * P / 4 + unsharded)
    c = CostModel(round_cluster(), m, ideal_profile(), zero_stage=0)
    np.testing.assert_allclose(c.model_state_bytes(), 16 * P)  # fp32 compute: no weight casts
    # bf16 compute, replicated: the bf16 casts of the weight matrices and the LM head the forward keeps
    bf = model_preset("llama-7b")
    h, f, L, V = bf.hidden, bf.ffn_hidden, bf.num_layers, bf.vocab_size
    c = CostModel(cluster_preset("zeppelin-a"), bf, zero_stage=0)
    np.testing.assert_allclose(c.model_state_bytes(), 16 * bf.num_params() + 2 * (L * (4 * h * h + 3 * h * f) + V * h))
    c = CostModel(cluster_preset("zeppelin-a"), bf, zero_stage=0, recompute="full")
    np.testing.assert_allclose(c.model_state_bytes(), 16 * bf.num_params() + 2 * V * h)
    # recomputation lowers the activation bytes per token: none > selective > full
    acts = [CostModel(round_cluster(), m, ideal_profile(), recompute=r).activation_bytes_per_token
            for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


def test_activation_memory_by_hand():
    """The per-token formulas, hand-computed for TINY (fp32, h 64, 4 heads of 16, 2 KV heads, FFN
    176, vocab 256, 2 layers) and its bf16 twin."""
    h, kv, f, V, heads, d, L = 64, 32, 176, 256, 4, 16, 2
    for dtype, c in (("fp32", 4), ("bf16", 2)):
        m = TINY.model_copy(update={"dtype": dtype})
        norm = (8 + c) * h + 4                       # fp32 input and normalised rows, c output, 1/rms
        attn = c * (2 * h + 2 * kv) + 4 * heads      # rotated Q, K, V, output; fp32 log-sum-exp
        mlp = 4 * c * f                              # gate, SiLU(gate), up, product
        layer = 2 * norm + attn + mlp
        head = norm + 4 * V + 16 + 4 * d             # final norm, fp32 log-softmax, ids+labels, cos/sin
        cm = {r: CostModel(round_cluster(), m, ideal_profile(), recompute=r) for r in ("none", "selective", "full")}
        assert cm["none"].layer_activation_parts() == {"norms": 2 * norm, "attention": attn, "mlp": mlp}
        np.testing.assert_allclose(cm["none"].activation_split, (L * layer + head, 0.0))
        np.testing.assert_allclose(cm["selective"].activation_split, (L * (layer - mlp) + head, mlp))
        # full: block inputs; one layer recomputed, less its input where the norm keeps it as is (fp32)
        np.testing.assert_allclose(cm["full"].activation_split,
                                   (L * c * h + head, layer - (4 * h if c == 4 else 0)))
    # a Hugging Face decoder: its norm keeps the normalised rows cast back (4 + 2c) h, cos/sin of d in c
    hf = TINY.model_copy(update={"dtype": "bf16", "remap_payload": "qkv"})
    c = CostModel(round_cluster(), hf, ideal_profile())
    norm = (4 + 4) * h + 4
    layer = 2 * norm + 2 * (2 * h + 2 * kv) + 4 * heads + 8 * f
    np.testing.assert_allclose(c.activation_split[0], L * layer + norm + 4 * V + 16 + 2 * 2 * d)


def test_activation_memory_and_capacity():
    c = CostModel(round_cluster(), TINY, ideal_profile())
    act, rec = c.activation_split
    # the backward's peak beyond the forward's: one recomputation or the loss's gradients (8 V)
    per_tok = act + max(rec, 8.0 * TINY.vocab_size)
    np.testing.assert_allclose(c.activation_bytes_per_token, per_tok)
    cap = int((10e9 - c.model_state_bytes()) / per_tok)
    assert c.token_capacity == cap
    np.testing.assert_allclose(c.memory_bytes(100), c.model_state_bytes() + 100 * per_tok)
    comp = c.memory_components(100)
    assert tuple(comp) == CostModel.MEMORY_COMPONENTS
    np.testing.assert_allclose(sum(comp.values()), c.memory_bytes(100))


def test_measured_activation_memory_replaces_the_formula():
    """A profile's measured figures for the model (``fits.activation_memory``) are used as they are;
    without them the profile's JSON (and content hash) is what it was."""
    from zeppelin.schemas.common import content_hash
    from zeppelin.schemas.profile import ActivationMemory, ModelFits

    prof = ideal_profile()
    plain = ModelFits(model=TINY.name, dtype=TINY.dtype)
    before = content_hash(prof.model_copy(update={"fits": [plain]}))
    assert "activation_memory" not in plain.model_dump_json()
    fits = plain.model_copy(update={"activation_memory": {"full": ActivationMemory(activations=1000.0, recompute=500.0)}})
    prof2 = prof.model_copy(update={"fits": [fits]})
    assert content_hash(prof2) != before
    c = CostModel(round_cluster(), TINY, prof2, recompute="full")
    assert c.activation_split == (1000.0, 500.0)
    assert c.activation_bytes_per_token == 1000.0 + max(500.0, 8.0 * TINY.vocab_size)
    # another recompute mode keeps the formula
    assert CostModel(round_cluster(), TINY, prof2).activation_split == CostModel(round_cluster(), TINY, prof).activation_split


def test_tensor_parallel_splits_work():
    c1 = CostModel(cluster_preset("zeppelin-a"), model_preset("llama-13b"), tp=1)
    c2 = CostModel(cluster_preset("zeppelin-a"), model_preset("llama-13b"), tp=2)
    assert c2.num_units == c1.num_units // 2
    assert float(c2.kv_bytes(100)) == pytest.approx(float(c1.kv_bytes(100)) / 2)
    assert float(c2.linear_time(8192)) < float(c1.linear_time(8192))
    with pytest.raises(ValueError):
        CostModel(cluster_preset("zeppelin-a"), model_preset("tiny"), tp=3)


def test_grad_allreduce():
    c = CostModel(round_cluster(nodes=1, gpn=4), TINY, ideal_profile())
    grad = TINY.num_params() * 4
    np.testing.assert_allclose(c.grad_allreduce_time(), 2 * 3 / 4 * grad / 10e9)
    assert c.grad_allreduce_time(1) == 0.0
    # two nodes of 2: reduce-scatter/all-gather inside the node (10 GB/s), the node's shards
    # all-reduced across nodes through its NIC (1 GB/s, 1 ms per message)
    c2 = CostModel(round_cluster(nodes=2, gpn=2), TINY, ideal_profile())
    expect = 2 * 1 / 2 * grad / 10e9 + 2 * 1 / 2 * grad / 1e9 + 2 * 1e-3
    np.testing.assert_allclose(c2.grad_allreduce_time(), expect)


def test_tp_overlap_modes_by_hand():
    cl = round_cluster(nodes=1, gpn=4)
    c = CostModel(cl, TINY, ideal_profile(), tp=2)
    T = 4096
    comm = T * 64 * 4 * (2 - 1) / 2 / 10e9          # all-gather/reduce-scatter of half the tokens' hidden, fp32
    gemm = float(c.linear_time(T)) / 8
    cm, gm = c.tp_site_times(T)
    np.testing.assert_allclose([float(cm), float(gm)], [comm, gemm])
    np.testing.assert_allclose(c.tp_exposed_comm(T, "none"), 8 * comm)
    np.testing.assert_allclose(c.tp_exposed_comm(T, "slicing"), 8 * (comm / 4 + 0.75 * max(comm - gemm, 0.0)))
    np.testing.assert_allclose(c.tp_exposed_comm(T, "commfuse"), 8 * max(comm - gemm / 2, 0.0))
    # compute-heavy GEMMs (slow device): CommFuse hides everything, slicing still pays one chunk's transfer
    slow = cl.model_copy(update={"gpu": cl.gpu.model_copy(update={"peak_tflops": 0.001})})
    cs = CostModel(slow, TINY, ideal_profile(), tp=2)
    assert float(cs.tp_exposed_comm(T, "commfuse")) == 0.0
    np.testing.assert_allclose(cs.tp_exposed_comm(T, "slicing"), 8 * comm / 4)
    assert float(CostModel(cl, TINY, ideal_profile()).tp_exposed_comm(T, "none")) == 0.0
    with pytest.raises(ValueError, match="unknown tp overlap mode 'x'"):
        c.tp_exposed_comm(T, "x")


def test_measured_ring_fits_replace_the_block_model():
    """A profile with the runtime's measured ring compute and per-round exchange cost: the cost model,
    the step prediction and the simulator all charge exactly those, split into rounds by the block
    model's proportions (profiles without them keep the block model)."""
    from zeppelin.planner.core.base import PlanContext
    from zeppelin.planner.costmodel.predict import predict_step
    from zeppelin.planner.sim.simulate import Simulator
    from zeppelin.schemas.layout import zigzag_ranges
    from zeppelin.schemas.plan import Group, MicroBatch, Placement, Sequence, StepPlan
    from zeppelin.schemas.profile import ModelFits, PolyFit

    cl = cluster_preset("local-cpu:1x2")
    model = model_preset("tiny")
    fits = ModelFits(model=model.name, dtype=model.dtype, attention=PolyFit(coeffs=[1e-4, 1e-7, 1e-10]),
                     linear=PolyFit(coeffs=[1e-4, 1e-6]), ring_compute={"2": PolyFit(coeffs=[2e-3, 0.0, 4e-10])},
                     ring_sync_s={"2": 3e-3})
    prof = CostProfile(fits=[fits], intra=LinkCost(alpha_s=60e-6, bandwidth_GBps=2.0))  # as a profile measures it
    cm = CostModel(cl, model, prof)
    L = np.array([512.0, 4096.0])
    want = 2e-3 + 4e-10 * L ** 2
    assert cm.ring_compute_time(L, 2) == pytest.approx(want, rel=1e-12)
    t0, tr = cm.ring_round_compute(L, 2)
    assert t0 + tr == pytest.approx(want, rel=1e-12) and np.all(t0 > 0) and np.all(tr > 0)
    assert cm.ring_exposed_comm(L, 2) == pytest.approx([3e-3, 3e-3])
    assert cm.ring_attention_time(L, 2) == pytest.approx(want + 3e-3, rel=1e-12)
    assert cm.ring_compute_measured(L, 4) is None and cm.ring_sync(4) is None  # not measured: block model
    # one ring of two units over a 4096-token sequence: prediction == simulation, exchanges included
    ctx = PlanContext(cl, model, prof)
    step = StepPlan(step=0, sequences=[Sequence(sample_id=0, length=4096)], microbatches=[MicroBatch(
        groups=[Group(kind="ring", tier="intra", units=[0, 1])],
        placements=[Placement(seq=0, group=0, scheme="zigzag", ranges=zigzag_ranges(4096, 2))],
        queues=[[0], [0]])])
    p = predict_step(ctx, step)
    r = Simulator(ctx).simulate_step(step)
    layers = model.num_layers
    assert p.per_unit.attention_s[0] == pytest.approx(layers * want[1], rel=1e-9)
    assert r.step_time_s == pytest.approx(p.step_time_s, rel=1e-6)
    assert r.units[0].attention_s + r.units[0].exposed_comm_s >= layers * (want[1] + 3e-3) * (1 - 1e-9)
