"""Plan / StepPlan: the execution plan shared by every planner, the simulator and the runtime.

File format (streamable, diffable): a header record, one record per training step, and an end
record ``{"kind": "end", "steps": N, "digest": "sha256:..."}`` whose digest is the SHA-256 of the
bytes of every record before it; readers check it as they stream, and a plan without it is refused
as truncated or edited. A reader reads the file through one open descriptor and checks each step
record it reads again against the record the verifying scan hashed, so replacing or rewriting the
file while it is read never changes the steps it returns.
Two encodings are read transparently:

* ``jsonl``  - one compact JSON object per line (large plans);
* ``pretty`` - each record pretty-printed over several lines, the record's closing brace alone
  on a line (golden plans in ``plans/``: readable, and ``git diff`` shows what changed).

Either way a reader holds one step in memory at a time (:class:`PlanReader`).

Vocabulary
----------
*unit*   A data-parallel unit: one model replica, i.e. ``tp`` GPU ranks that share a tensor-
         parallel layout. With ``tp == 1`` (the default) unit ``u`` is GPU rank ``u``. Every rank
         list in a step (groups, layouts, queues, routes) names units. ``StepPlan.replicas``
         gives the GPU ranks of each unit when they are not the default ``[u*tp, (u+1)*tp)``
         (Hydraulis plans mix replicas of different TP degree in one step).
*group*  A set of units that run attention for some sequences together, in ring order:
         ``local`` (one unit, whole sequences), ``ring`` (zigzag ring attention, P2P K/V passing),
         ``allgather`` (LLaMA-3 style all-gather of K/V), ``ulysses`` (all-to-all head scatter),
         ``usp`` (2-D: ``shape = [u, r]``, Ulysses inside each of r rows of u units, a ring across
         the rows; units listed row by row, position ``i*u + j`` is row i, Ulysses position j).
         ``kv_replication`` (Ulysses and usp groups) states on how many positions of a row each
         KV head lands when the row has more positions than the unit has KV heads.
*placement*  Where one sequence's attention runs: its group and, for each ring position of the
         group, the token ranges ``[start, end)`` held there (zigzag: position i holds chunks i and
         2G-1-i of 2G equal chunks).
*segment*  ``[seq, start, end]``: tokens ``start..end-1`` of sequence ``seq`` of the step.

A unit's *attention buffer* is the concatenation of its segments in queue order (for each group
in its queue, for each placement of that group in placement order, the unit's ranges). When
``linear_layout`` is set, the linear modules (MLP, embeddings, LM head) see the tokens in that
layout instead and the runtime remaps activations between the two.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Iterator, Literal

from pydantic import Field, ValidationError, model_serializer, model_validator

from .cluster import ClusterSpec
from .common import Doc, InputError, Strict, content_hash, format_validation_error
from .invariants import structural_problems  # the checks every read runs (also imported from here)
from .io.documents import parse_json
from .io.safefiles import atomic_write, check_input_file
from .model import ModelSpec
from .profile import CostProfile

PLAN_SCHEMA = "zeppelin.plan/1"

#: Every plan format version there has been, with the zeppelin releases that read it (a stable
#: surface: docs/API.md). A new format gets a new entry; old entries stay.
PLAN_FORMAT_READERS = {"zeppelin.plan/1": "zeppelin 0.1.0 and later 0.x releases"}


def format_version_message(version: Any) -> str:
    """The one-line reason a plan whose header says ``schema_version: version`` cannot be read
    here, naming the zeppelin that reads it (older and newer formats alike)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _pkg_version

    try:
        mine = f"zeppelin {_pkg_version('zeppelin')}"
    except PackageNotFoundError:  # not installed as a distribution (a source checkout)
        mine = "this zeppelin"
    prefix, _, num = str(version).rpartition("/")
    cur = int(PLAN_SCHEMA.rpartition("/")[2])
    if prefix != "zeppelin.plan" or not num.isdigit():
        return (f"plan schema_version {version!r} is not a zeppelin plan format "
                f"({mine} reads {PLAN_SCHEMA!r})")
    n = int(num)
    if n < cur:
        readers = PLAN_FORMAT_READERS.get(str(version), "unreleased development versions before zeppelin 0.1.0")
        return (f"plan format {version!r} is older than {mine} reads ({PLAN_SCHEMA!r}); {readers} read it: "
                "re-plan with `zeppelin plan` to get a current plan")
    return (f"plan format {version!r} is newer than {mine} reads ({PLAN_SCHEMA!r}); it was written by a later "
            "zeppelin: upgrade zeppelin to read it")

GroupKind = Literal["local", "ring", "allgather", "ulysses", "usp"]
MAX_LENGTH = 1 << 40  # longest sequence a plan may name (the manifest readers' bound too)
MAX_INDEX = 1 << 48  # largest sample id
Tier = Literal["local", "intra", "inter"]
#: a micro-batch's recomputation: a global mode, or full recomputation of its first k layers
MICROBATCH_RECOMPUTE = r"^(none|selective|full|full:[1-9][0-9]{0,5})$"


class Sequence(Strict):
    sample_id: int = Field(ge=0, le=MAX_INDEX, description="index of the sample in the manifest")
    length: int = Field(ge=1, le=MAX_LENGTH, description="tokens used (after truncation)")
    truncated_from: int | None = Field(default=None, ge=1, le=MAX_LENGTH, description="original length if truncated")


class Replica(Strict):
    """The GPU ranks of one data-parallel unit and its tensor-parallel degree."""

    ranks: list[int] = Field(min_length=1)
    tp: int = Field(ge=1)

    @model_validator(mode="after")
    def _tp(self) -> "Replica":
        if len(self.ranks) != self.tp:
            raise ValueError(f"replica has {len(self.ranks)} ranks but tp={self.tp}")
        return self


class Group(Strict):
    kind: GroupKind
    tier: Tier
    units: list[int] = Field(min_length=1, description="ring order (usp: row by row)")
    shape: list[int] | None = Field(default=None, min_length=2, max_length=2,
                                    description="usp only: [u, r], Ulysses over u units inside each of r ring rows")
    kv_replication: int | None = Field(default=None, ge=1, le=1024,
                                       description="ulysses/usp: positions of a Ulysses row holding each KV head")

    @model_validator(mode="after")
    def _check(self) -> "Group":
        if len(set(self.units)) != len(self.units):
            raise ValueError(f"group lists a unit twice: {self.units}")
        if self.kind == "local" and len(self.units) != 1:
            raise ValueError("a local group has exactly one unit")
        if self.kind == "usp":
            if self.shape is None or self.kv_replication is None:
                raise ValueError("a usp group states its shape [u, r] and its kv_replication")
            u, r = self.shape
            if u < 1 or r < 1 or u * r != len(self.units):
                raise ValueError(f"usp group shape {self.shape} does not arrange its {len(self.units)} units")
        elif self.shape is not None:
            raise ValueError(f"a {self.kind} group has no shape (only usp groups do)")
        if self.kv_replication is not None and self.kind not in ("ulysses", "usp"):
            raise ValueError(f"a {self.kind} group has no kv_replication (only ulysses and usp groups do)")
        return self

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        """Plans without usp groups or stated replication keep their bytes: unset fields are left out."""
        data = handler(self)
        for key in ("shape", "kv_replication"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    def row_size(self) -> int:
        """Positions of one Ulysses row (usp: u; ulysses: the group; others: 1)."""
        if self.kind == "usp":
            return self.shape[0]  # type: ignore[index]
        return len(self.units) if self.kind == "ulysses" else 1


class Placement(Strict):
    seq: int = Field(ge=0, description="index into StepPlan.sequences")
    group: int = Field(ge=0, description="index into MicroBatch.groups")
    scheme: Literal["whole", "zigzag", "contiguous"] = "whole"
    padded_length: int | None = Field(
        default=None, ge=1, le=MAX_LENGTH, description="length after padding (e.g. to a multiple of 2*CP); tokens >= length are padding"
    )
    ranges: list[list[list[int]]] = Field(
        description="for each ring position of the group, the [start, end) token ranges held there"
    )


class RoutePath(Strict):
    via_src: int = Field(description="proxy unit on the source node (== src for the direct path)")
    via_dst: int = Field(description="proxy unit on the destination node (== dst for the direct path)")
    nic_src: str
    nic_dst: str
    tokens: int = Field(ge=0, le=MAX_LENGTH, description="tokens of the K/V block carried on this path")


class Route(Strict):
    """An inter-node ring transfer (one per ring round) split over NIC paths."""

    group: int = Field(ge=0)
    src: int
    dst: int
    tokens: int = Field(ge=0, le=MAX_LENGTH, description="K/V tokens moved src->dst per ring round")
    bytes: int = Field(ge=0, le=1 << 62, description="bytes per ring round per layer (forward)")
    paths: list[RoutePath] = Field(min_length=1)

    @model_validator(mode="after")
    def _sum(self) -> "Route":
        if sum(p.tokens for p in self.paths) != self.tokens:
            raise ValueError(f"route {self.src}->{self.dst}: path tokens do not add up to {self.tokens}")
        return self


class RemapInfo(Strict):
    enabled: bool = False
    reason: str = ""
    tokens_moved: int = 0
    tokens_moved_inter: int = 0
    predicted_saving_s: float | None = None


class MicroBatch(Strict):
    groups: list[Group] = Field(default_factory=list)
    #: this micro-batch's activation recomputation (:data:`MICROBATCH_RECOMPUTE`); only in a plan whose
    #: header says ``recompute: per-microbatch``, and written only when set (None: ``none``)
    recompute: str | None = Field(default=None, pattern=MICROBATCH_RECOMPUTE,
                                  description="none | selective | full | full:k (the first k layers)")
    #: the units that run another choice than :attr:`recompute`, per choice (ascending; None: none
    #: do): a unit whose tokens fit without recomputation need not pay for it, and one that fits
    #: with fewer layers recomputed than its neighbours runs those. Written only when set
    recompute_units: dict[Annotated[str, Field(pattern=MICROBATCH_RECOMPUTE)], list[int]] | None = Field(
        default=None, description="choice -> the units (ascending) that run it instead of recompute (absent: none)")
    placements: list[Placement] = Field(default_factory=list)
    queues: list[list[int]] = Field(description="per unit: group indices in execution order")
    linear_layout: list[list[list[int]]] | None = Field(
        default=None, description="per unit: [seq, start, end] segments for the linear modules (None: no remap)"
    )
    remap: RemapInfo = RemapInfo()
    routes: list[Route] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_unset_recompute(self, handler):
        # per micro-batch recomputation came after plans were first written: left out when unset, so
        # every other plan keeps its bytes
        d = handler(self)
        if isinstance(d, dict):
            for key in ("recompute", "recompute_units"):
                if key in d and d[key] is None:
                    d.pop(key)
        return d

    def recompute_of(self, unit: int) -> str | None:
        """The recomputation ``unit`` runs in this micro-batch: its choice in :attr:`recompute_units`,
        else :attr:`recompute` (None: the plan's global mode, ``none`` in a plan of choices)."""
        for mode, units in (self.recompute_units or {}).items():
            i = bisect.bisect_left(units, unit)
            if i < len(units) and units[i] == unit:
                return mode
        return self.recompute

    def recomputes(self) -> bool:
        """Whether some unit of this micro-batch names a recomputation of its own (other than ``none``)."""
        return (self.recompute not in (None, "none")
                or any(m != "none" and us for m, us in (self.recompute_units or {}).items()))

    def attention_segments(self, unit: int) -> list[list[int]]:
        """The unit's attention buffer as ``[seq, start, end]`` segments, in execution order."""
        return self.attention_layout([unit])[0]

    def attention_layout(self, units) -> list[list[list[int]]]:
        """:meth:`attention_segments` of each of ``units`` (an int: units ``0 .. units-1``), in one
        pass over the placements (per unit it would scan them all: quadratic in a large step)."""
        by_group: dict[int, list[Placement]] = {}
        for p in self.placements:
            by_group.setdefault(p.group, []).append(p)
        out: list[list[list[int]]] = []
        for u in (range(units) if isinstance(units, int) else units):
            segs: list[list[int]] = []
            for g in self.queues[u]:
                pos = self.groups[g].units.index(u)
                for p in by_group.get(g, ()):
                    for s, e in p.ranges[pos]:
                        if e > s:
                            segs.append([p.seq, s, e])
            out.append(segs)
        return out

    def linear_segments(self, unit: int) -> list[list[int]]:
        if self.linear_layout is None:
            return self.attention_segments(unit)
        return [list(s) for s in self.linear_layout[unit]]


Seconds = Annotated[float, Field(ge=-1e9, le=1e9)]  # a predicted time: finite, at most ~30 years


class RankLoads(Strict):
    """Per-unit predictions (struct of arrays, index = unit)."""

    attention_s: list[Seconds]
    linear_s: list[Seconds]
    comm_s: list[Seconds]
    exposed_comm_s: list[Seconds]
    total_s: list[Seconds]
    tokens: list[Annotated[int, Field(ge=0, le=MAX_LENGTH)]]
    memory_gb: list[Annotated[float, Field(ge=-1e9, le=1e9)]]


class Prediction(Strict):
    step_time_s: float = Field(ge=0, le=1e9)
    lower_bound_s: float = Field(ge=0, le=1e9, description="max(work_bound, longest_bound)")
    work_bound_s: float = Field(ge=0, le=1e9, description="total work / number of GPUs")
    longest_bound_s: float = Field(ge=0, le=1e9, description="best possible time of the longest sequence")
    per_unit: RankLoads
    nic_bytes: dict[str, float] = Field(default_factory=dict, description="bytes per NIC per step, with routing")
    nic_bytes_unrouted: dict[str, float] = Field(default_factory=dict, description="same, without routing")


class SolverInfo(Strict):
    name: str = Field(description="e.g. highs, cbc, greedy")
    status: str = Field(default="ok", description="ok (no solver), optimal, work_limit (node / iteration limit: "
                                                  "reproducible), wall_clock_limit (the optional wall-clock safety "
                                                  "net fired: the step depends on the machine's load)")
    gap: float | None = Field(default=None, description="relative optimality gap (0 = proven optimal)")
    # planning wall time: kept in memory for reports, never written (plan bytes must not depend on
    # the machine's load); older plans that carry it still read
    time_s: float = Field(default=0.0, exclude=True)
    fallback_reason: str | None = None


class StepPlan(Strict):
    kind: Literal["step"] = "step"
    step: int = Field(ge=0)
    sequences: list[Sequence] = Field(min_length=1)
    replicas: list[Replica] | None = Field(default=None, description="None: uniform units of header.tp ranks")
    microbatches: list[MicroBatch] = Field(min_length=1)
    prediction: Prediction | None = None
    solver: SolverInfo | None = None
    notes: dict[str, Any] = Field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.sequences)


class InputHashes(Strict):
    cluster: str
    model: str
    profile: str
    manifest: str


#: how a sample longer than ``--max-seq-len`` is handled (the first: the default)
OVERFLOW_MODES = ("truncate", "reject", "skip")
#: the activation recomputation a plan's memory model assumes and ``zeppelin run`` uses (the first: the default)
RECOMPUTE_MODES = ("none", "selective", "full")
#: the header's value when each micro-batch carries its own choice (``MicroBatch.recompute``)
PER_MICROBATCH = "per-microbatch"
#: what a plan header's ``recompute`` may say
HEADER_RECOMPUTE = (*RECOMPUTE_MODES, PER_MICROBATCH)


def parse_recompute(mode: str) -> tuple[str, int | None]:
    """``"full:k"`` -> ``("full", k)``; a global mode -> ``(mode, None)``. ValueError otherwise."""
    kind, sep, k = mode.partition(":")
    if not sep and kind in RECOMPUTE_MODES:
        return kind, None
    if kind == "full" and k.isdigit() and int(k) >= 1:
        return "full", int(k)
    raise ValueError(f"recompute {mode!r} is not one of none, selective, full, full:k")
#: the ZeRO stages of the memory model and of ``zeppelin run``'s sharding
ZERO_STAGES = (0, 1, 2, 3)


class ManifestRef(Strict):
    path: str = ""
    format: str = ""
    num_samples: int = 0
    num_tokens: int = 0
    #: the manifest holds token ids (then ``zeppelin run`` needs it as ``--data``); written only when true,
    #: so plans of lengths-only manifests keep their bytes
    token_ids: bool = False

    @model_serializer(mode="wrap")
    def _drop_default_token_ids(self, handler):
        data = handler(self)
        if not self.token_ids:
            data.pop("token_ids", None)
        return data


class SamplerConfig(Strict):
    tokens_per_step: int | None = Field(default=None, ge=1)
    seqs_per_step: int | None = Field(default=None, ge=1)
    shuffle: bool = True
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    max_seq_len: int | None = Field(default=None, ge=1)
    overflow: Literal[OVERFLOW_MODES] = "truncate"
    start_sample: int = Field(default=0, ge=0)


class PlanHeader(Doc):
    schema_version: Literal["zeppelin.plan/1"] = PLAN_SCHEMA
    kind: Literal["header"] = "header"
    planner: str
    planner_options: dict[str, Any] = Field(default_factory=dict)
    zeppelin_version: str = ""
    created_at: str = ""
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    num_steps: int = Field(ge=0, le=1_000_000)
    world_size: int = Field(ge=1, description="GPU ranks")
    tp: int = Field(default=1, ge=1, description="default tensor-parallel degree of a unit")
    tp_overlap: Literal["none", "slicing", "commfuse"] = "none"
    zero_stage: int = Field(default=1, ge=ZERO_STAGES[0], le=ZERO_STAGES[-1])
    recompute: Literal[HEADER_RECOMPUTE] = Field(
        default="none", description="activation recomputation the memory model assumed (zeppelin run must match); "
                                    "per-microbatch: each micro-batch says its own")
    cluster: ClusterSpec
    model: ModelSpec
    profile: CostProfile
    hashes: InputHashes
    manifest: ManifestRef = ManifestRef()
    sampler: SamplerConfig = SamplerConfig()

    @model_serializer(mode="wrap")
    def _omit_default_recompute(self, handler):
        # added after plans were first written: left out while "none", so plans (and their bytes
        # and digests) without recomputation are unchanged
        d = handler(self)
        if isinstance(d, dict) and d.get("recompute", None) == "none":
            d.pop("recompute")
        return d

    @model_validator(mode="after")
    def _check(self) -> "PlanHeader":
        if self.world_size != self.cluster.world_size:
            raise ValueError(
                f"world_size {self.world_size} does not match the cluster ({self.cluster.world_size} GPUs)"
            )
        if self.cluster.gpus_per_node % self.tp:
            raise ValueError(f"tp={self.tp} does not divide the cluster's {self.cluster.gpus_per_node} GPUs per node")
        return self

    @property
    def num_units(self) -> int:
        return self.world_size // self.tp

    def replicas(self, step: StepPlan | None = None) -> list[Replica]:
        if step is not None and step.replicas is not None:
            return step.replicas
        return list(uniform_replicas(self.world_size, self.tp))


@functools.lru_cache(maxsize=64)
def uniform_replicas(world_size: int, tp: int) -> tuple[Replica, ...]:
    """Units of ``tp`` consecutive ranks, made once per shape (every check of every step asks for them;
    callers only read them)."""
    return tuple(Replica(ranks=list(range(u * tp, (u + 1) * tp)), tp=tp) for u in range(world_size // tp))


# ---------------------------------------------------------------------------------------------
# Streaming reader / atomic writer
# ---------------------------------------------------------------------------------------------


def _dump(record: Doc | Strict, fmt: str) -> str:
    data = record.model_dump(mode="json", exclude_none=False)
    if fmt == "jsonl":
        return json.dumps(data, separators=(",", ":")) + "\n"
    return _pretty(data) + "\n"


def _pretty(obj: Any, indent: int = 0) -> str:
    """Pretty JSON that keeps short lists (ranges, segments) on one line for readable diffs."""
    flat = json.dumps(obj, separators=(", ", ": "))
    if len(flat) + indent <= 100 or not isinstance(obj, (dict, list)) or not obj:
        return flat
    pad = " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {_pretty(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{pad}{_pretty(v, indent + 1)}" for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


class PlanWriter:
    """Write a plan atomically: nothing appears at ``path`` unless every step was written.

    >>> with PlanWriter(path, header) as w:
    ...     for step in steps: w.write(step)
    """

    def __init__(self, path: str | os.PathLike, header: PlanHeader, fmt: Literal["jsonl", "pretty"] = "jsonl", *,
                 replaces: bool = False):
        self.path, self.header, self.fmt = Path(path), header, fmt
        self.replaces = replaces  # True: the plan replaces one read from the same path (check --update)
        self._cm = None
        self._fh = None
        self.count = 0

    def __enter__(self) -> "PlanWriter":
        cm = atomic_write(self.path, replaces=self.replaces)
        fh = cm.__enter__()
        try:
            self._cm, self._fh = cm, fh
            self._digest = hashlib.sha256()
            self._put(_dump(self.header, self.fmt))
        except BaseException:
            # the with statement calls __exit__ only once __enter__ has returned: a failure here
            # (a SIGTERM landing while the header is written) removes the temporary file now
            if not cm.__exit__(*sys.exc_info()):
                raise
        return self

    def _put(self, text: str) -> None:
        data = text.encode()
        self._digest.update(data)
        self._fh.write(text)

    def write(self, step: StepPlan) -> None:
        if step.step != self.count:
            raise ValueError(f"steps must be written in order: expected step {self.count}, got {step.step}")
        self._put(_dump(step, self.fmt))
        self.count += 1

    def __exit__(self, et, ev, tb):
        if et is None and self.count != self.header.num_steps:
            err = ValueError(f"header promises {self.header.num_steps} steps, {self.count} written")
            self._cm.__exit__(ValueError, err, None)  # removes the temporary file
            raise err
        if et is None:
            self._fh.write(end_record(self.count, self._digest))
        return self._cm.__exit__(et, ev, tb)


def end_record(steps: int, digest: "hashlib._Hash") -> str:
    """The last record of a plan: the step count and a SHA-256 digest of every record before it (the
    bytes as written), so that a reader detects any edit of the header or of any step."""
    return json.dumps({"kind": "end", "steps": steps, "digest": "sha256:" + digest.hexdigest()},
                      separators=(",", ":")) + "\n"


def plan_text(header: PlanHeader, steps, fmt: Literal["jsonl", "pretty"] = "jsonl") -> str:
    """The exact text :class:`PlanWriter` writes for these records (end record included)."""
    digest = hashlib.sha256()
    parts = []
    for r in [header, *steps]:
        t = _dump(r, fmt)
        digest.update(t.encode())
        parts.append(t)
    parts.append(end_record(len(parts) - 1, digest))
    return "".join(parts)


def write_plan(path, header: PlanHeader, steps, fmt: Literal["jsonl", "pretty"] = "jsonl") -> None:
    with PlanWriter(path, header, fmt) as w:
        for s in steps:
            w.write(s)


#: records this short are parsed by the verifying scan in case they are the end record (which the writer
#: writes in about 110 bytes); longer ones only when they contain ``"end"``
_END_RECORD_MAX = 1024

#: the integrity problem of a plan of this format without its end record
NO_END_RECORD = ("integrity check failed: no end record (the plan is truncated or was edited; a plan ends with "
                 "the digest of its records)")


class PlanReader:
    """Stream a plan file: the header is read on open, steps one at a time.

    ``reader.step(k)`` seeks to step ``k`` through an offset index built by one scan of the file
    (bounded memory). Every step is checked against the ``coverage`` invariant (:mod:`.invariants`) when read
    (``check=False`` skips that); a malformed or truncated record is reported with its step number.
    """

    def __init__(self, path: str | os.PathLike, *, check: bool = True, digest: str | None = None):
        self.path = Path(path)
        self.check = check
        self.expected_digest = digest  # the end record must carry this digest (zeppelin run's ranks)
        if not self.path.exists():
            raise InputError("plan file not found", source=self.path)
        if self.path.is_dir():
            raise InputError("is a directory, not a plan file", source=self.path)
        check_input_file(self.path, "plan")
        self._offsets: list[int] | None = None
        self._record_digests: list[bytes] = []  # SHA-256 of each step record as the verifying scan read it
        self._integrity: str | None = None  # set by a full scan: why the plan fails its integrity check
        self.digest: str | None = None  # the end record's digest, once a full scan verified it
        # one open file for the reader's life: every record comes from the file verified, even if the
        # path is replaced by another file meanwhile
        self._fh = self.path.open("rb")
        rec, self._first_step_offset = self._read_record(self._fh, 0, what="header")
        self._header_raw = self._raw
        if rec is None:
            raise InputError("empty plan file", source=self.path)
        if rec.get("kind") != "header":
            raise InputError("first record is not a plan header", source=self.path)
        ver = rec.get("schema_version")
        if ver != PLAN_SCHEMA:
            raise InputError(format_version_message(ver), source=self.path)
        try:
            self.header = PlanHeader.model_validate(rec)
        except ValidationError as e:
            raise InputError(f"invalid plan header: {format_validation_error(e)}", source=self.path) from None

    # A record is either one JSON line, or a pretty block ending with a line that is exactly "}".
    # ``self._raw`` keeps the bytes of the record just read (for the integrity digest).
    def _read_raw(self, fh, offset: int, what: str) -> tuple[bytes | None, int]:
        """The bytes of the record at ``offset`` (also kept as ``self._raw``) and the next offset;
        None at the end of the file. Nothing is parsed."""
        self._raw = b""
        fh.seek(offset)
        line = fh.readline()
        while line and not line.strip():
            line = fh.readline()
        if not line:
            return None, fh.tell()
        if line.rstrip(b"\r\n") != b"{":
            text = line
        else:
            buf = [line]
            while True:
                nxt = fh.readline()
                if not nxt:
                    raise InputError(f"{what}: truncated record (file ends inside it)", source=self.path)
                buf.append(nxt)
                if nxt.rstrip(b"\r\n") == b"}":
                    break
            text = b"".join(buf)
        self._raw = text
        return text, fh.tell()

    def _read_record(self, fh, offset: int, what: str) -> tuple[dict | None, int]:
        text, nxt = self._read_raw(fh, offset, what)
        if text is None:
            return None, nxt
        try:
            rec = parse_json(text, source=self.path, what=what)
        except InputError as e:
            if e.problem.startswith(f"{what}: malformed JSON") or e.problem == f"{what}: not UTF-8 text":
                msg = e.problem.split(": ", 2)[-1] if "malformed" in e.problem else "not UTF-8 text"
                raise InputError(f"{what}: corrupt or truncated record ({msg})", source=self.path) from None
            raise
        if not isinstance(rec, dict):
            raise InputError(f"{what}: record is not a JSON object", source=self.path)
        return rec, nxt

    def _parse_step(self, rec: dict, k: int) -> StepPlan:
        try:
            step = StepPlan.model_validate(rec)
        except ValidationError as e:
            raise InputError(f"step {k}: invalid step record: {format_validation_error(e)}", source=self.path) from None
        if step.step != k:
            raise InputError(f"step {k}: record says step {step.step} (steps out of order)", source=self.path)
        if self.check:
            probs = structural_problems(self.header, step, limit=1)
            if probs:
                raise InputError(f"step {k}: invalid plan: {probs[0]}", source=self.path)
        return step

    def _end_problem(self, rec: dict, k: int, digest, fh) -> str | None:
        """Why the end record does not vouch for the ``k`` records before it (None: it does)."""
        if set(rec) != {"kind", "steps", "digest"} or not isinstance(rec["digest"], str):
            return "end record: expected exactly kind, steps and digest"
        if rec["steps"] != k:
            return f"end record: it counts {rec['steps']} steps, the file has {k}"
        if rec["digest"] != "sha256:" + digest.hexdigest():
            return ("integrity check failed: the records do not match the digest of the end record "
                    "(the plan was edited after it was written)")
        if fh.read(1 << 16).strip():
            return "integrity check failed: records after the end record"
        if self.expected_digest is not None and rec["digest"] != self.expected_digest:
            return (f"integrity check failed: the plan's digest is {rec['digest']}, not the {self.expected_digest} "
                    "expected (the file was replaced after it was checked)")
        self.digest = rec["digest"]
        return None

    def close(self) -> None:
        self._fh.close()

    def __del__(self) -> None:
        fh = getattr(self, "_fh", None)
        if fh is not None:
            fh.close()

    def __iter__(self) -> Iterator[StepPlan]:
        """Steps in order, each checked when read; the digest of the end record (plans written before
        it existed have none) is checked once every record has been read."""
        digest = hashlib.sha256(self._header_raw)
        fh = self._fh
        off = self._first_step_offset
        k = 0
        ended = False
        while True:
            rec, off = self._read_record(fh, off, what=f"step {k}")
            if rec is None:
                break
            if rec.get("kind") == "end":
                problem = self._end_problem(rec, k, digest, fh)
                if problem:
                    raise InputError(problem, source=self.path)
                ended = True
                break
            digest.update(self._raw)
            yield self._parse_step(rec, k)
            k += 1
        if k != self.header.num_steps:
            raise InputError(f"step {k}: plan is truncated (header promises {self.header.num_steps} steps, file has {k})",
                             source=self.path)
        if not ended:
            raise InputError(NO_END_RECORD, source=self.path)

    def _index(self) -> list[int]:
        """Offsets of the step records, from one scan that also checks the integrity digest."""
        if self._offsets is None:
            offs = []
            digest = hashlib.sha256(self._header_raw)
            fh = self._fh
            off = self._first_step_offset
            k = 0
            self._integrity = NO_END_RECORD  # until the end record vouches for every record before it
            while True:
                pos = off
                raw, nxt = self._read_raw(fh, off, what=f"step {k}")
                if raw is None:
                    break
                # only a record that can be the end record is parsed here: the end record is short and
                # names "end"; a step record is parsed when it is read (after this scan vouched for it)
                if len(raw) <= _END_RECORD_MAX or b'"end"' in raw:
                    rec, nxt = self._read_record(fh, off, what=f"step {k}")
                    if rec.get("kind") == "end":
                        fh.seek(nxt)
                        self._integrity = self._end_problem(rec, k, digest, fh)
                        break
                digest.update(raw)
                self._record_digests.append(hashlib.sha256(raw).digest())
                offs.append(pos)
                off = nxt
                k += 1
            self._offsets = offs
        return self._offsets

    def step_hashes(self, n: int) -> list[str]:
        """The content hashes of the first ``n`` steps (what a checkpoint's plan prefix is made of),
        each step hashed once for the reader's life (a checkpoint every step stays linear)."""
        cache = self.__dict__.setdefault("_step_hashes", [])
        while len(cache) < n:
            self._note_step(self.step(len(cache)))
        return cache[:n]

    def _note_step(self, step: StepPlan) -> None:
        """Keep the content hash of the next step in order (see :meth:`step_hashes`)."""
        cache = self.__dict__.setdefault("_step_hashes", [])
        if step.step == len(cache):
            cache.append(content_hash(step.model_dump(mode="json")))

    def verify(self) -> None:
        """Read every record once and check the plan's integrity digest (its end record)."""
        self._index()
        if self._integrity:
            raise InputError(self._integrity, source=self.path)

    def __len__(self) -> int:
        return self.header.num_steps

    def step(self, k: int) -> StepPlan:
        offs = self._index()
        if not 0 <= k < len(offs):
            if k < self.header.num_steps:
                raise InputError(f"step {k}: plan is truncated (file has {len(offs)} steps)", source=self.path)
            raise InputError(f"step {k} out of range (plan has {self.header.num_steps} steps)", source=self.path)
        rec, _ = self._read_record(self._fh, offs[k], what=f"step {k}")
        if hashlib.sha256(self._raw).digest() != self._record_digests[k]:
            raise InputError(f"step {k}: the plan file changed after it was verified (its record is not the one "
                             "read then)", source=self.path)
        step = self._parse_step(rec, k)
        if self._integrity:  # after the step's own checks, which name what is wrong more precisely
            raise InputError(self._integrity, source=self.path)
        return step


def sample_problems(step: StepPlan, lengths: Any) -> list[str]:
    """Every sequence of the step names a sample of the manifest (``lengths``: its per-sample lengths)
    and uses no more tokens than the sample has."""
    probs = []
    n = len(lengths)
    for i, seq in enumerate(step.sequences):
        if seq.sample_id >= n:
            probs.append(f"step {step.step}: sequence {i} names sample {seq.sample_id}, beyond the manifest's "
                         f"{n:,} samples")
        elif seq.length > int(lengths[seq.sample_id]):
            probs.append(f"step {step.step}: sequence {i} uses {seq.length:,} tokens of sample {seq.sample_id}, "
                         f"which has {int(lengths[seq.sample_id]):,}")
    return probs


def check_embedded_specs(reader: PlanReader) -> None:
    """The cluster, model and profile embedded in the header are the ones its hashes record (``run``
    trains the embedded model; an edit of it that left the hashes alone is refused here)."""
    h = reader.header
    for name in ("cluster", "model", "profile"):
        got, want = content_hash(getattr(h, name)), getattr(h.hashes, name)
        if got != want:
            raise InputError(f"the plan's embedded {name} hashes to {got}, its header records {want} (the plan was "
                             f"edited after planning)", source=reader.path)


def read_plan(path: str | os.PathLike, *, check: bool = True) -> tuple[PlanHeader, list[StepPlan]]:
    """Read a whole plan (small plans, tests). Use :class:`PlanReader` to stream large ones."""
    r = PlanReader(path, check=check)
    return r.header, list(r)

