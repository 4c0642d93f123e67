"""Tables every command prints, readable in an 80-column terminal.

One helper builds them all (:func:`table`): light borders (a rule under the header, no vertical
lines) so that the columns, not the frame, get the width; every column at least as wide as the
longest word of its header, so a header wraps between words onto a second line but never loses
letters ("toke…"); cell text that does not fit wraps instead of being cut. Headers are written as
short words (``"mean ms"``), stacked by rich when the terminal is narrow. :func:`console` is the
console commands print to (the terminal's width, ``COLUMNS`` honoured); :func:`render_text` renders
a table at a given width (tests check every command's table at 80 columns with it).

A table never breaks a word: when the longest words of its columns do not fit the width, whole
columns are left out (the last ones first, or those the table names), and the caption says which
(:class:`FitTable`); a wider terminal shows them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from zeppelin.schemas.common import fit_width as wrapped  # noqa: F401 (the commands' line wrapping)

__all__ = ["EXPOSED_NOTE", "console", "exposed_cell", "fmt_tokens", "print_stats", "render_text",
           "simulate_step_tables", "simulate_summary_table",
           "stats_payload", "table"]


@functools.cache
def _fit_table_class():
    from rich.table import Table

    class FitTable(Table):
        """A rich ``Table`` that leaves out whole columns rather than fold a word at a narrow width."""

        drop_order: list[str] | None = None  # headers, the first left out first (default: from the right)

        def __rich_console__(self, console, options):
            if len(self.rows) > LONG_TABLE_ROWS:
                fast = _long_table_lines(self, console, options)
                if fast is not None:
                    yield from fast
                    return
            t = self._fitted(console, options)
            yield from Table.__rich_console__(t, console, options)

        def __rich_measure__(self, console, options):
            return Table.__rich_measure__(self._fitted(console, options), console, options)

        def _fitted(self, console, options):
            import copy

            width = options.max_width
            for c in self.columns:  # rich may narrow a column below its longest word: never below
                words = [w for cell in c._cells for w in _plain(cell).split()]
                c.min_width = max([c.min_width or 0, *map(len, words)])
            order = list(self.drop_order) if self.drop_order is not None else [
                c.header for c in reversed(self.columns[1:])]
            t, dropped = self, []
            while order and (_needed(t) > width or not _fits_whole(t, width)):
                name = order.pop(0)
                keep = [c for c in t.columns if c.header != name]
                if len(keep) == len(t.columns):
                    continue
                t = copy.copy(t)
                t.columns = keep
                dropped.append(name)
            if dropped:
                note = f"not shown at this width: {', '.join(dropped)} (a wider terminal shows them)"
                t.caption = f"{t.caption}; {note}" if t.caption else note
            return t

    return FitTable


#: tables longer than this (``zeppelin simulate`` of a long plan: one row per step) are laid out by
#: rich on a few representative rows, and their rows written with the widths rich chose
LONG_TABLE_ROWS = 200


def _long_table_lines(t, console, options):
    """The segments of a long table of plain cells (no markup, no column style), as rich renders it:
    rich lays out and renders a copy holding only the rows with each column's longest line and
    longest word (the rows that decide the columns' widths); every row is then written with those
    widths, each cell justified as its column says. The copy's rows, written so, must equal rich's
    own rendering of them; None (the caller renders the whole table with rich) when they do not or
    when a cell is not plain text."""
    import copy

    from rich.segment import Segment
    from rich.table import Table

    cols = t.columns
    cells = [c._cells for c in cols]
    if any(c.style for c in cols) or not all(isinstance(x, str) and "[" not in x for cc in cells for x in cc):
        return None
    keep = set()
    for cc in cells:
        keep.add(max(range(len(cc)), key=lambda i: max(map(len, cc[i].split("\n")))))
        keep.add(max(range(len(cc)), key=lambda i: max((len(w) for w in cc[i].split()), default=0)))
    rows = sorted(keep)
    proxy = copy.copy(t)
    proxy.rows = [t.rows[i] for i in rows]
    proxy.columns = [copy.copy(c) for c in cols]
    for c, cc in zip(proxy.columns, cells):
        c._cells = [cc[i] for i in rows]
    fitted = proxy._fitted(console, options)
    shown = [cols.index(next(c for c in cols if c.header == f.header)) for f in fitted.columns]
    width = fitted.width if fitted.width is not None else options.max_width  # as Table.__rich_console__ does
    widths = fitted._calculate_column_widths(console, options.update_width(width - fitted._extra_width))
    last = len(shown) - 1

    def row_lines(i):
        parts = [cells[k][i].split("\n") for k in shown]
        height = max(map(len, parts))
        out = []
        for h in range(height):
            line = []
            for j, (k, w) in enumerate(zip(shown, widths)):
                text = parts[j][h] if h < len(parts[j]) else ""
                inner = w - (0 if j == last else 1)
                text = text.rjust(inner) if cols[k].justify == "right" else text.ljust(inner)
                line.append(text + ("" if j == last else " "))
            out.append(" ".join(line))
        return out

    def lines_of(table):
        return ["".join(s.text for s in ln) for ln in Segment.split_lines(Table.__rich_console__(table, console, options))]

    full = list(Segment.split_lines(Table.__rich_console__(fitted, console, options)))
    bare = copy.copy(fitted)
    bare.caption = None
    n_head = len(lines_of(bare)) - sum(len(row_lines(i)) for i in rows)
    mine = [ln for i in rows for ln in row_lines(i)]
    theirs = ["".join(s.text for s in ln) for ln in full[n_head:n_head + len(mine)]]
    if n_head < 0 or mine != theirs:
        return None
    tail = full[n_head + len(mine):]

    def segments():
        for ln in full[:n_head]:
            yield from ln
            yield Segment.line()
        for i in range(len(t.rows)):
            for text in row_lines(i):
                yield Segment(text)
                yield Segment.line()
        for ln in tail:
            yield from ln
            yield Segment.line()

    return segments()


def _needed(t) -> int:
    """The narrowest a table of :func:`table` can be without breaking a word: each column's longest
    word, and two spaces between columns (padding 1 on each side, none at the edges)."""
    return sum(c.min_width or 0 for c in t.columns) + 2 * max(len(t.columns) - 1, 0)


def _plain(cell) -> str:
    if isinstance(cell, str):
        from rich.text import Text

        return Text.from_markup(cell).plain
    return getattr(cell, "plain", "")


def _fits_whole(t, width: int) -> bool:
    """:func:`_whole`, narrowing every column to its longest word (headers then wrap between words)
    where rich's own layout would otherwise cut one."""
    if _whole(t, width):
        return True
    for c in t.columns:
        c.max_width = c.min_width
    if _whole(t, width):
        return True
    for c in t.columns:
        c.max_width = None
    return False


def _whole(t, width: int) -> bool:
    """Whether ``t`` renders at ``width`` with every word of its headers and cells whole."""
    import io

    from rich.console import Console
    from rich.table import Table

    class _Raw:  # the table as rich lays it out, without fitting it again
        def __rich_console__(self, console, options):
            yield from Table.__rich_console__(t, console, options)

    con = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, legacy_windows=False)
    con.print(_Raw())
    from collections import Counter

    tokens = Counter(con.file.getvalue().split())
    words = Counter(w for c in t.columns for cell in [c.header, *c._cells] for w in _plain(cell).split())
    return all(tokens[w] >= k for w, k in words.items())


def __getattr__(name: str):
    if name == "FitTable":  # built on first use: rich is imported only by commands that print tables
        return _fit_table_class()
    raise AttributeError(name)


def table(title: str | None, columns: Sequence[str | tuple[str, str]], *, caption: str | None = None,
          show_header: bool = True, styles: dict[str, str] | None = None, drop: Sequence[str] | None = None):
    """A rich ``Table`` with ``columns`` (a header, or ``(header, justify)``; the first column is
    left-justified and the others right-justified unless given). ``drop``: the headers of the columns
    to leave out first when the table does not fit (default: from the last column on)."""
    from rich import box

    t = _fit_table_class()(title=title, caption=caption, title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
              show_header=show_header, pad_edge=False, padding=(0, 1), collapse_padding=True, show_edge=False)
    for i, spec in enumerate(columns):
        header, justify = (spec, "left" if i == 0 else "right") if isinstance(spec, str) else spec
        longest_word = max((len(w) for w in header.split()), default=0)
        t.add_column(header, justify=justify, min_width=longest_word, overflow="fold",
                     style=(styles or {}).get(header))
    if drop is not None:
        t.drop_order = list(drop)
    return t


def console(stderr: bool = False, **kw: Any):
    """The console a command prints to: the terminal's width (``COLUMNS`` when set)."""
    from rich.console import Console

    return Console(stderr=stderr, **kw)


def render_text(renderable, width: int = 80) -> str:
    """``renderable`` as plain text at ``width`` columns (no colour)."""
    import io

    from rich.console import Console

    con = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, legacy_windows=False)
    con.print(renderable)
    return con.file.getvalue()


# ------------------------------------------------------------------ the tables of `zeppelin simulate`
def _np():
    import numpy as np

    return np


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def exposed_cell(transfers_s: float, sync_s: float, fmt=None) -> str:
    """An exposed-communication cell in two labelled parts: the transfers compute does not hide
    (attention, routing, remap), below it ``+`` the gradient sync (all-reduce or FSDP)."""
    fmt = fmt or _ms
    return f"{fmt(transfers_s)}\n+{fmt(sync_s)}"


#: what an exposed-communication cell holds (captions of the tables that show one)
EXPOSED_NOTE = ("exposed: communication no compute hides, ms, mean over units: transfers (attention, "
                "routing, remap), below it + the gradient sync (all-reduce or FSDP)")


def simulate_summary_table(header, results):
    """`zeppelin simulate`: one row per simulated step."""
    t = table(f"simulated steps: planner {header.planner}, {header.cluster.name} "
              f"({header.world_size} GPUs, tp={header.tp}), {header.model.name}",
              [(c, "right") for c in ("step", "sim ms", "pred ms", "LB ms", "xLB", "busy %", "exposed ms", "idle ms",
                                      "NIC busy %")],
              caption="busy / idle: mean over units; " + EXPOSED_NOTE + "; NIC busy: the busiest NIC; xLB: "
                      "simulated step / lower bound (docs/CONCEPTS.md)")
    for r in results:
        busy = _np().mean([u.busy_s for u in r.units]) / r.step_time_s * 100 if r.step_time_s else 0.0
        t.add_row(
            str(r.step), _ms(r.step_time_s), _ms(r.predicted_s) if r.predicted_s is not None else "-",
            _ms(r.lower_bound_s), f"{r.step_time_s / r.lower_bound_s:.2f}" if r.lower_bound_s else "-",
            f"{busy:.1f}", exposed_cell(r.exposed_transfers_s, r.allreduce_s), _ms(float(_np().mean([u.idle_s for u in r.units]))),
            f"{r.max_nic_busy_frac * 100:.1f}",
        )
    return t


def simulate_step_tables(r):
    """`zeppelin simulate --step K`: per unit, and per NIC."""
    t = table(f"step {r.step}: {_ms(r.step_time_s)} ms simulated "
              f"(compute until {_ms(r.compute_end_s)} ms, gradient sync {_ms(r.allreduce_s)} ms: "
              "exposed ms includes it)",
              [(c, "right") for c in ("unit", "tokens", "attn ms", "linear ms", "busy ms", "exposed ms", "idle ms",
                                      "busy %")])
    for u, s in enumerate(r.units):
        t.add_row(str(u), str(s.tokens), _ms(s.attention_s), _ms(s.linear_s), _ms(s.busy_s), _ms(s.exposed_comm_s),
                  _ms(s.idle_s), f"{s.busy_s / r.step_time_s * 100:.1f}" if r.step_time_s else "-")
    nt = table(f"step {r.step}: NICs", ["NIC", "GB moved", "busy ms", "busy %", "bandwidth use %"])
    for k, v in r.nics.items():
        nt.add_row(k, f"{v.bytes / 1e9:.3f}", _ms(v.busy_s), f"{v.busy_frac * 100:.1f}", f"{v.util * 100:.1f}")
    return t, nt


# ------------------------------------------------------------------ a dataset's statistics (data stats, demo)
BAR_WIDTH = 14


def fmt_tokens(n: float) -> str:
    """Compact token counts: 512, 4K, 1.5K, 128K, 2M (K = 1024)."""
    n = float(n)
    for div, suf in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if n >= div:
            v = n / div
            return f"{v:.0f}{suf}" if abs(v - round(v)) < 0.05 or v >= 100 else f"{v:.1f}{suf}"
    return f"{n:.0f}"


def _bar(share: float, top: float) -> str:
    if top <= 0:
        return ""
    cells = share / top * BAR_WIDTH
    full = int(cells)
    frac = cells - full
    partial = " ▏▎▍▌▋▊▉"[int(frac * 8)] if full < BAR_WIDTH else ""
    return ("█" * full + partial).rstrip()


def stats_payload(dataset) -> dict[str, Any]:
    """Everything `data stats --json` prints: the dataset description plus the histogram."""
    from zeppelin.schemas.io.datasets import length_histogram

    d = dataset.describe()
    d["histogram"] = length_histogram(dataset.lengths)
    return d


def print_stats(dataset, con=None, title: str | None = None) -> None:
    """Summary table and log2 length histogram with rich, on ``con`` (default: :func:`console`)."""
    from rich.table import Table

    con = con or console()
    d = stats_payload(dataset)
    t = Table(title=title or f"manifest {dataset.source}", show_header=False, title_justify="left")
    t.add_column("", style="bold")
    t.add_column("")
    t.add_row("format", f"{d['format']} ({d['shards']} shard{'s' if d['shards'] != 1 else ''})"
              + (", token ids" if d["has_tokens"] else ""))
    t.add_row("samples", f"{d['num_samples']:,}")
    t.add_row("tokens", f"{d['num_tokens']:,}")
    t.add_row("mean length", f"{d['mean']:,.1f}")
    t.add_row("min / max", f"{d['min']:,} / {d['max']:,}")
    t.add_row("percentiles", "  ".join(f"{k} {v:,.0f}" for k, v in d["percentiles"].items()))
    t.add_row("content hash", d["content_hash"])
    con.print(t)
    hist = d["histogram"]
    top_s = max(b["sample_share"] for b in hist)
    top_t = max(b["token_share"] for b in hist)
    h = table("length histogram (log2 buckets)", [("length", "right"), "samples", "% samples", ("", "left"),
                                                  "% tokens", ("", "left")])
    h.columns[3].style, h.columns[3].min_width = "cyan", BAR_WIDTH
    h.columns[5].style, h.columns[5].min_width = "magenta", BAR_WIDTH
    for b in hist:
        h.add_row(f"{fmt_tokens(b['lo'])}-{fmt_tokens(b['hi'])}", f"{b['samples']:,}",
                  f"{100 * b['sample_share']:.2f}", _bar(b["sample_share"], top_s),
                  f"{100 * b['token_share']:.2f}", _bar(b["token_share"], top_t))
    con.print(h)
