"""Plan files: streaming reader, atomic writer, structural invariants."""

import json

import pytest

from zeppelin.schemas.cluster import cluster_preset
from zeppelin.schemas.common import InputError, content_hash
from zeppelin.schemas.layout import contiguous_ranges, split_even, zigzag_ranges
from zeppelin.schemas.model import model_preset
from zeppelin.schemas.plan import (
    Group,
    InputHashes,
    MicroBatch,
    Placement,
    PlanHeader,
    PlanReader,
    PlanWriter,
    Replica,
    Route,
    RoutePath,
    Sequence,
    StepPlan,
    read_plan,
    structural_problems,
    write_plan,
)
from zeppelin.schemas.profile import default_profile


def header(num_steps=3, cluster="local-cpu:2x2", **kw) -> PlanHeader:
    c = cluster_preset(cluster)
    m = model_preset("tiny")
    p = default_profile(c.name, "cpu")
    return PlanHeader(planner="test", num_steps=num_steps, world_size=c.world_size, cluster=c, model=m, profile=p,
                      hashes=InputHashes(cluster=content_hash(c), model=content_hash(m), profile=content_hash(p),
                                         manifest="sha256:0"), **kw)


def three_tier_step(k=0) -> StepPlan:
    """4 units on 2 nodes: one inter-node ring over all 4, one intra-node ring, local sequences."""
    seqs = [Sequence(sample_id=10 + k, length=37), Sequence(sample_id=11, length=9),
            Sequence(sample_id=12, length=5), Sequence(sample_id=13, length=300)]
    groups = [Group(kind="ring", tier="inter", units=[0, 1, 2, 3]), Group(kind="ring", tier="intra", units=[2, 3]),
              Group(kind="local", tier="local", units=[0]), Group(kind="local", tier="local", units=[1])]
    pl = [Placement(seq=3, group=0, scheme="zigzag", ranges=zigzag_ranges(300, 4)),
          Placement(seq=0, group=1, scheme="zigzag", ranges=zigzag_ranges(37, 2)),
          Placement(seq=1, group=2, ranges=[[[0, 9]]]), Placement(seq=2, group=3, ranges=[[[0, 5]]])]
    routes = [Route(group=0, src=1, dst=2, tokens=75, bytes=75 * 256,
                    paths=[RoutePath(via_src=1, via_dst=2, nic_src="node0/nic0", nic_dst="node1/nic0", tokens=75)])]
    mb = MicroBatch(groups=groups, placements=pl, queues=[[0, 2], [0, 3], [0, 1], [0, 1]], routes=routes)
    return StepPlan(step=k, sequences=seqs, microbatches=[mb])


def test_layout_helpers():
    assert split_even(10, 4) == [3, 3, 2, 2]
    z = zigzag_ranges(10, 2)
    assert z == [[[0, 3], [8, 10]], [[3, 6], [6, 8]]]
    assert zigzag_ranges(3, 2)[1] == [[1, 2], [2, 3]] and zigzag_ranges(3, 2)[0] == [[0, 1], [3, 3]]
    assert contiguous_ranges(7, 3) == [[[0, 3]], [[3, 5]], [[5, 7]]]


def test_valid_step_has_no_problems():
    assert structural_problems(header(), three_tier_step()) == []


def test_attention_segments_follow_queue_order():
    mb = three_tier_step().microbatches[0]
    assert mb.attention_segments(0) == [[3, 0, 38], [3, 263, 300], [1, 0, 9]]
    assert mb.attention_segments(2) == [[3, 76, 114], [3, 189, 226], [0, 0, 10], [0, 28, 37]]
    assert mb.linear_segments(2) == mb.attention_segments(2)


@pytest.mark.parametrize("fmt", ["jsonl", "pretty"])
def test_round_trip_and_random_access(tmp_path, fmt):
    h = header()
    steps = [three_tier_step(k) for k in range(3)]
    path = tmp_path / f"p.{fmt}"
    write_plan(path, h, steps, fmt=fmt)
    r = PlanReader(path)
    assert r.header == h
    assert list(r) == steps
    assert r.step(2) == steps[2] and r.step(0) == steps[0]
    hh, ss = read_plan(path)
    assert ss == steps
    text = path.read_text()
    if fmt == "jsonl":
        assert len(text.splitlines()) == 5  # header, 3 steps, end record
    else:  # readable: one record per block, short lists kept on one line
        assert "[[0, 38], [263, 300]]" in text
        assert sum(1 for line in text.splitlines() if line == "}") == 4


def test_step_out_of_range(tmp_path):
    path = tmp_path / "p.jsonl"
    write_plan(path, header(1), [three_tier_step(0)])
    with pytest.raises(InputError) as e:
        PlanReader(path).step(5)
    assert str(e.value) == f"{path}: step 5 out of range (plan has 1 steps)"


def test_writer_is_atomic(tmp_path):
    path = tmp_path / "p.jsonl"
    with pytest.raises(ValueError, match="header promises 3 steps, 1 written"):
        with PlanWriter(path, header(3)) as w:
            w.write(three_tier_step(0))
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError):
        with PlanWriter(path, header(1)) as w:
            raise RuntimeError("planner crashed")
    assert list(tmp_path.iterdir()) == []


def test_truncated_plan_reports_step(tmp_path):
    path = tmp_path / "p.jsonl"
    write_plan(path, header(3), [three_tier_step(k) for k in range(3)])
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    r = PlanReader(path)
    it = iter(r)
    next(it), next(it)
    with pytest.raises(InputError) as e:
        next(it)
    assert str(e.value).startswith(f"{path}: step 2: corrupt or truncated record")
    path.write_text("".join(lines[:3]))
    with pytest.raises(InputError) as e:
        list(PlanReader(path))
    assert str(e.value) == f"{path}: step 2: plan is truncated (header promises 3 steps, file has 2)"


def test_pretty_truncated(tmp_path):
    path = tmp_path / "p.json"
    write_plan(path, header(1), [three_tier_step(0)], fmt="pretty")
    text = path.read_text()
    text = text[: text.rindex('{"kind":"end"')]  # the end record and the last 40 characters of the step
    path.write_text(text[: len(text) - 40])
    with pytest.raises(InputError) as e:
        list(PlanReader(path))
    assert str(e.value) == f"{path}: step 0: truncated record (file ends inside it)"


def test_corrupt_step_record(tmp_path):
    path = tmp_path / "p.jsonl"
    write_plan(path, header(2), [three_tier_step(0), three_tier_step(1)])
    lines = path.read_text().splitlines(keepends=True)
    rec = json.loads(lines[2])
    rec["sequences"][0]["length"] = -4
    lines[2] = json.dumps(rec) + "\n"
    path.write_text("".join(lines))
    with pytest.raises(InputError) as e:
        PlanReader(path).step(1)
    assert str(e.value) == (f"{path}: step 1: invalid step record: sequences.0.length: "
                            "Input should be greater than or equal to 1")


def test_reader_rejects_bad_files(tmp_path):
    with pytest.raises(InputError) as e:
        PlanReader(tmp_path / "nope.jsonl")
    assert str(e.value).endswith("nope.jsonl: plan file not found")
    p = tmp_path / "e.jsonl"
    p.write_text("")
    with pytest.raises(InputError, match="empty plan file"):
        PlanReader(p)
    p.write_text('{"kind": "step"}\n')
    with pytest.raises(InputError, match="first record is not a plan header"):
        PlanReader(p)
    d = json.loads(header().model_dump_json())
    d["schema_version"] = "zeppelin.plan/0"
    p.write_text(json.dumps(d) + "\n")
    with pytest.raises(InputError) as e:
        PlanReader(p)
    assert ("plan format 'zeppelin.plan/0' is older than zeppelin 0.1.0 reads ('zeppelin.plan/1'); unreleased "
            "development versions before zeppelin 0.1.0 read it: re-plan with `zeppelin plan` to get a current plan"
            in str(e.value))


def test_dropped_chunk_is_detected(tmp_path):
    st = three_tier_step()
    st.microbatches[0].placements[0].ranges[1] = [[38, 76]]  # drop chunk 6 of the inter-node sequence
    probs = structural_problems(header(), st)
    assert probs == ["step 0: attention layout misses tokens 226..262 of sequence 3"]
    path = tmp_path / "p.jsonl"
    write_plan(path, header(1), [st])
    with pytest.raises(InputError) as e:
        list(PlanReader(path))
    assert str(e.value) == f"{path}: step 0: invalid plan: step 0: attention layout misses tokens 226..262 of sequence 3"
    assert len(list(PlanReader(path, check=False))) == 1


def test_other_invariants():
    h = header()
    st = three_tier_step()
    st.microbatches[0].placements[2].ranges = [[[0, 12]]]
    assert structural_problems(h, st) == ["step 0: attention layout runs past the end of sequence 1 (covers 12 of 9 tokens)"]
    st = three_tier_step()
    st.microbatches[0].placements[3].ranges = [[[0, 5], [3, 5]]]
    assert structural_problems(h, st) == ["step 0: attention layout covers tokens 3..4 of sequence 2 twice"]
    st = three_tier_step()
    st.microbatches[0].queues[3] = [1]
    assert structural_problems(h, st) == [
        "step 0 microbatch 0: unit 3 is in group 0 but does not queue it (ring order broken)"]
    st = three_tier_step()
    st.microbatches[0].queues[1] = [0, 3, 2]
    assert structural_problems(h, st) == ["step 0 microbatch 0: unit 1 queues group 2 it is not a member of"]
    st = three_tier_step()
    del st.microbatches[0].placements[2]
    assert structural_problems(h, st) == ["step 0: sequence 1 (sample 11) has no attention placement"]


def test_linear_layout_coverage():
    h = header()
    st = three_tier_step()
    mb = st.microbatches[0]
    total = sum(s.length for s in st.sequences)
    assert total == 351
    # a token-balanced layout: cut the concatenation of all sequences into 4 near-equal pieces
    flat = [(i, 0, s.length) for i, s in enumerate(st.sequences)]
    sizes = split_even(total, 4)
    layout, cur, fi, off = [], [], 0, 0
    for want in sizes:
        cur = []
        while want:
            i, s, e = flat[fi]
            take = min(want, e - (s + off))
            cur.append([i, s + off, s + off + take])
            want -= take
            off += take
            if s + off == e:
                fi, off = fi + 1, 0
        layout.append(cur)
    mb.linear_layout = layout
    assert structural_problems(h, st) == []
    assert [sum(e - s for _, s, e in mb.linear_segments(u)) for u in range(4)] == [88, 88, 88, 87]
    mb.linear_layout[3] = mb.linear_layout[3][:-1]
    assert structural_problems(h, st)[0].startswith("step 0: linear layout misses")


def test_replicas_must_cover_ranks():
    h = header()
    st = three_tier_step()
    st.replicas = [Replica(ranks=[0], tp=1), Replica(ranks=[1], tp=1), Replica(ranks=[2], tp=1),
                   Replica(ranks=[2], tp=1)]
    assert structural_problems(h, st)[0] == "replicas do not cover GPU ranks 0..3 exactly once"
    assert [r.ranks for r in h.replicas()] == [[0], [1], [2], [3]]


def test_written_files_get_normal_permissions(tmp_path):
    import os
    import stat

    from zeppelin.schemas.io.safefiles import atomic_write_text

    p = tmp_path / "x.json"
    atomic_write_text(p, "{}")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask


def test_a_signal_whose_exception_a_library_wraps_is_still_a_termination():
    """A SIGTERM whose exception a library turns into its own (pydantic wraps one raised inside a
    serializer) still ends the write as a termination: exit 128+N, not a traceback."""
    import os
    import signal

    from zeppelin.schemas.io.signals import Terminated, cleanup_signals

    with pytest.raises(Terminated) as ei:
        with cleanup_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs between two bytecodes
                    pass
            except Terminated:
                raise ValueError("Error calling function `_omit_unset_recompute`") from None
    assert ei.value.signum == signal.SIGTERM
    assert isinstance(ei.value.__cause__, ValueError)


def test_a_writer_left_suspended_by_a_termination_closes_quietly():
    """A termination that leaves a writer's generator suspended (``with`` calls ``__exit__`` only
    once ``__enter__`` has returned) must not raise when the generator is closed later - at the end
    of the process that would print a traceback after zeppelin's one line."""
    import signal

    from zeppelin.schemas.io.signals import cleanup_signals

    cm = cleanup_signals()
    state = cm.__enter__()
    state.received = signal.SIGTERM
    cm.gen.close()  # GeneratorExit at the yield: cleans up, raises nothing


def test_a_signal_while_the_plan_header_is_written_removes_the_temporary_file(tmp_path, monkeypatch):
    """SIGTERM landing in PlanWriter.__enter__ after its temporary file exists (while the header is
    written): the temporary file is gone when the exception leaves ``with``, not when the
    collector finds the writer, and nothing is left at the plan's name."""
    import signal

    from zeppelin.schemas import plan as plan_mod
    from zeppelin.schemas.io.signals import Terminated
    from zeppelin.schemas.plan import PlanHeader, PlanWriter

    def dump(record, fmt):
        raise Terminated(signal.SIGTERM)

    monkeypatch.setattr(plan_mod, "_dump", dump)
    writer = PlanWriter(tmp_path / "p.jsonl", PlanHeader.model_construct())
    with pytest.raises(Terminated):
        with writer:
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, number", [
    (b'{"notes": {"a": [1e999]}}', "1e999"),
    (b'[1, 2E+400]', "2E+400"),
    (b'[' + b"9" * 400 + b'.5]', "9" * 400 + ".5"),
    (b'{"x": -Infinity}', "-Infinity"),
    (b'[NaN]', "NaN"),
])
def test_parse_json_refuses_every_non_finite_number(text, number):
    """The parser skips its per-float check when no number can round to infinity: whatever can still does."""
    from zeppelin.schemas.io.documents import parse_json

    with pytest.raises(InputError) as e:
        parse_json(text, what="step 3")
    assert e.value.problem == f"step 3: {number} is not a finite number (JSON numbers must be finite)"


def test_parse_json_numbers_as_float_reads_them():
    from zeppelin.schemas.io.documents import parse_json

    nums = ["1e308", "1.5e-999", "1e+99", "0.1", "123456789012345678901234567890.5e99", "7" * 31 + "e99", "-2.5E-07"]
    assert parse_json(("[" + ",".join(nums) + "]").encode()) == [float(n) for n in nums]


@pytest.mark.parametrize("depth, refused", [(64, False), (65, True)])
@pytest.mark.parametrize("shape", ["arrays", "objects", "mixed", "siblings", "in-string"])
def test_json_depth_bound_is_exact(depth, refused, shape):
    """The depth check strips innermost pairs before any array work: 64 levels still read, 65 do not,
    whatever the brackets (brackets inside strings do not count)."""
    from zeppelin.schemas.io.documents import parse_json

    if shape == "arrays":
        text = "[" * depth + "]" * depth
    elif shape == "objects":
        text = '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)
    elif shape == "mixed":
        text = '[{"a":' * (depth // 2) + ("[]" if depth % 2 else "1") + "}]" * (depth // 2)
    elif shape == "siblings":  # many shallow pairs beside the deep one
        text = "[" + "[]," * 200 + "[" * (depth - 1) + "]" * (depth - 1) + "]"
    else:
        text = '["' + "[" * 100 + '",' + "[" * (depth - 1) + "]" * (depth - 1) + "]"
    if refused:
        with pytest.raises(InputError) as e:
            parse_json(text.encode(), what="step 0")
        assert e.value.problem == "step 0: JSON nested deeper than 64 levels"
    else:
        assert parse_json(text.encode()) is not None
