"""Process-group cache: every sub-group a plan needs, created once and collectively at start-up.

Creating a ``torch.distributed`` process group is a collective over *all* ranks of the world,
in the same order on every rank, and it is slow (a store rendezvous, and for NCCL a communicator).
So the runtime never creates groups while it trains: :class:`GroupCache` collects, before the first
step, every rank set the plan can ask for, creates them in one deterministic order, and afterwards
only looks them up (:meth:`GroupCache.get`). Asking for a group that was not pre-created is an
error with a clear message, never a silent collective that would hang the other ranks.

What is pre-created (GPU ranks; "unit" = data-parallel replica of ``tp`` ranks, see
``zeppelin.schemas.plan``):

* aligned power-of-two blocks of units ``[k*2^j, (k+1)*2^j)`` for ``2 <= 2^j <= units`` — the
  FlexSP pool: every rank belongs to at most ``log2(units)`` of them. With ``tp > 1`` a block of
  units becomes one group per tensor-parallel index ``t`` (``ranks[t]`` of each unit), which is the
  group a head-scattering all-to-all over those units uses;
* the tensor-parallel group of every replica (uniform ``header.tp``, and every ``replicas`` list of
  the steps given — Hydraulis plans mix TP degrees);
* the unit groups of ``ulysses`` / ``allgather`` groups of the steps given that are not aligned
  blocks, and the rows of their ``usp`` groups (each row's all-to-all), expanded per TP index as
  above;
* any ``extra`` rank lists the caller adds (e.g. gradient-synchronisation groups).

Group identity is the *set* of ranks (torch orders a group's ranks ascending); a single rank has
no group (:meth:`get` returns ``None``), and the set of all ranks is the default group.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from zeppelin.schemas.plan import PlanHeader, StepPlan

__all__ = ["GroupCache", "GroupNotCreatedError", "aligned_blocks", "plan_rank_sets", "get_group",
           "set_default_cache", "default_cache"]


class GroupNotCreatedError(KeyError):
    """A process group was requested that the cache did not create at start-up."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "process group not pre-created"


def aligned_blocks(n: int) -> list[list[int]]:
    """Aligned power-of-two blocks ``[k*s, (k+1)*s)`` of ``range(n)`` for ``s = 2, 4, ...``.

    Each index lies in at most ``floor(log2(n))`` blocks (one per size).
    """
    out: list[list[int]] = []
    s = 2
    while s <= n:
        for k in range(n // s):
            out.append(list(range(k * s, (k + 1) * s)))
        s *= 2
    return out


def _per_tp_index(units: Sequence[int], reps) -> list[tuple[int, ...]]:
    """One rank set per TP index for a set of units (units of different TP degree: the common
    TP indices only — a head-scattering group needs the same TP layout on each member)."""
    tps = {reps[u].tp for u in units}
    if len(tps) != 1:
        return []
    tp = tps.pop()
    return [tuple(sorted(reps[u].ranks[t] for u in units)) for t in range(tp)]


def plan_rank_sets(header: PlanHeader | None, steps: Iterable[StepPlan] = (),
                   world_size: int | None = None) -> list[tuple[int, ...]]:
    """Every rank set (sorted tuples, >= 2 ranks) the cache creates for ``header`` and ``steps``.

    Deterministic: the same inputs give the same list in the same order on every rank.
    """
    sets: dict[tuple[int, ...], None] = {}

    def add(rs: Iterable[int]) -> None:
        t = tuple(sorted(set(int(r) for r in rs)))
        if len(t) >= 2:
            sets.setdefault(t, None)

    if header is None:
        if world_size is not None:
            for b in aligned_blocks(world_size):
                add(b)
        return list(sets)
    reps0 = header.replicas()
    for rep in reps0:
        add(rep.ranks)
    for block in aligned_blocks(len(reps0)):
        for rs in _per_tp_index(block, reps0):
            add(rs)
    for step in steps:
        reps = header.replicas(step)
        for rep in reps:
            add(rep.ranks)
        if step.replicas is not None:
            for block in aligned_blocks(len(reps)):
                for rs in _per_tp_index(block, reps):
                    add(rs)
        for mb in step.microbatches:
            for g in mb.groups:
                if g.kind in ("ulysses", "allgather") and len(g.units) >= 2:
                    if all(0 <= u < len(reps) for u in g.units):
                        for rs in _per_tp_index(g.units, reps):
                            add(rs)
                elif g.kind == "usp" and g.shape is not None and g.shape[0] >= 2:
                    u = g.shape[0]  # the all-to-all of each row
                    for i in range(0, len(g.units), u):
                        if all(0 <= x < len(reps) for x in g.units[i:i + u]):
                            for rs in _per_tp_index(g.units[i:i + u], reps):
                                add(rs)
    return list(sets)


class GroupCache:
    """Pre-created process groups, looked up by rank set.

    ``GroupCache(world_size, header=None, steps=(), extra=())`` must be constructed on every rank
    with the same arguments (all ranks read the same plan), after ``init_process_group``. It calls
    ``dist.new_group`` once per rank set, in the same order everywhere. Without a header it creates
    the aligned power-of-two blocks of ranks.
    """

    def __init__(self, world_size: int | None = None, header: PlanHeader | None = None,
                 steps: Iterable[StepPlan] = (), extra: Iterable[Sequence[int]] = (),
                 backend: str | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("GroupCache needs torch.distributed to be initialised first")
        ws = dist.get_world_size()
        if world_size is None:
            world_size = ws
        if world_size != ws:
            raise RuntimeError(f"GroupCache built for world size {world_size}, but the job has {ws} ranks")
        if header is not None and header.world_size != ws:
            raise RuntimeError(f"the plan is for {header.world_size} ranks, but the job has {ws}")
        self.world_size = ws
        self.rank = dist.get_rank()
        sets = plan_rank_sets(header, steps, world_size=ws)
        seen = set(sets)
        for rs in extra:
            t = tuple(sorted(set(int(r) for r in rs)))
            if len(t) >= 2 and t not in seen:
                seen.add(t)
                sets.append(t)
        for t in sets:
            bad = [r for r in t if not 0 <= r < ws]
            if bad:
                raise RuntimeError(f"group {list(t)} names ranks {bad} outside the world of {ws}")
        self._groups: dict[tuple[int, ...], Any] = {}
        everyone = tuple(range(ws))
        for t in sets:
            if t == everyone:
                self._groups[t] = dist.group.WORLD
                continue
            pg = dist.new_group(list(t), backend=backend)
            # non-members get a placeholder; keep only groups this rank belongs to
            if self.rank in t:
                self._groups[t] = pg
        self.created = len(sets)
        self.member_of = sorted(self._groups)
        self._known = set(sets)
        self._backend = backend
        self._header = header

    def add_steps(self, steps: Iterable[StepPlan]) -> int:
        """Create the groups of further steps that are not created yet (a plan followed while it is
        written: its steps arrive one at a time). Collective: every rank calls it with the same
        steps, in the same order. Returns the number of groups created."""
        import torch.distributed as dist

        made = 0
        for t in plan_rank_sets(self._header, steps, world_size=self.world_size):
            if t in self._known or t == tuple(range(self.world_size)):  # (all ranks: the default group)
                continue
            self._known.add(t)
            pg = dist.new_group(list(t), backend=self._backend)
            if self.rank in t:
                self._groups[t] = pg
            made += 1
        self.created += made
        self.member_of = sorted(self._groups)
        return made

    def get(self, ranks: Iterable[int]):
        """The group of exactly these GPU ranks (any order); ``None`` for a single rank."""
        import torch.distributed as dist

        t = tuple(sorted(set(int(r) for r in ranks)))
        if len(t) <= 1:
            return None
        if t == tuple(range(self.world_size)):
            return dist.group.WORLD
        pg = self._groups.get(t)
        if pg is None:
            if self.rank not in t:
                raise GroupNotCreatedError(
                    f"rank {self.rank} asked for process group {list(t)}, which it is not a member of")
            raise GroupNotCreatedError(
                f"process group {list(t)} was not pre-created at start-up (the plan does not name it); "
                f"groups are created once, collectively, before training — add it to GroupCache(extra=...)")
        return pg

    def __contains__(self, ranks: Iterable[int]) -> bool:
        t = tuple(sorted(set(int(r) for r in ranks)))
        return len(t) <= 1 or t == tuple(range(self.world_size)) or t in self._groups

    def __len__(self) -> int:
        return len(self._groups)


_DEFAULT: GroupCache | None = None
_RELEASE_AT_EXIT = False


def set_default_cache(cache: GroupCache | None) -> None:
    """Install the cache :func:`get_group` looks groups up in (the executor does this at start-up).

    The first install also registers :func:`_release_at_exit`: a training script that ends with
    ``dist.destroy_process_group()`` (or without it) still holds process groups - in this cache, in
    the model's FSDP state, in collected-later cycles - and a gloo group destroyed while the
    interpreter finalises aborts the process ("terminate called without an active exception": its
    worker thread cannot take the GIL any more) after the job itself succeeded."""
    global _DEFAULT, _RELEASE_AT_EXIT
    _DEFAULT = cache
    if cache is not None and not _RELEASE_AT_EXIT:
        import atexit

        atexit.register(_release_at_exit)
        _RELEASE_AT_EXIT = True


def _release_at_exit() -> None:
    """At exit, before the interpreter finalises: drop the default cache and collect the garbage
    cycles, so that the process groups they hold are destroyed while threads can still take the
    GIL (a group's destructor releases it and joins its worker threads)."""
    import gc

    set_default_cache(None)
    gc.collect()


def default_cache() -> GroupCache | None:
    return _DEFAULT


def get_group(ranks: Iterable[int]):
    """Look ``ranks`` up in the default cache (``None`` for one rank; the default group for all)."""
    import torch.distributed as dist

    t = tuple(sorted(set(int(r) for r in ranks)))
    if len(t) <= 1:
        return None
    if dist.is_initialized() and t == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    if _DEFAULT is None:
        raise GroupNotCreatedError(
            f"process group {list(t)} requested before a GroupCache was installed (set_default_cache)")
    return _DEFAULT.get(t)
