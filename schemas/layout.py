"""Pure helpers for token layouts shared by planners, the simulator and the runtime."""

from __future__ import annotations


def split_even(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` near-equal pieces of ``n`` (the first ``n % parts`` get one more)."""
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def zigzag_ranges(length: int, G: int) -> list[list[list[int]]]:
    """Cut ``[0, length)`` into 2G near-equal chunks; ring position i holds chunks i and 2G-1-i.

    Returns, per ring position, its two ``[start, end)`` ranges (a chunk may be empty when
    ``length < 2G``). This balances the causal mask: every position gets one early and one late chunk.
    """
    if G == 1:
        return [[[0, length]]]
    n = 2 * G
    if type(length) is int:  # (whole numbers: chunk k starts at k q + min(k, r), the sizes' prefix sum)
        q, r = divmod(length, n)
        bounds = [k * q + min(k, r) for k in range(n + 1)]
    else:
        bounds = [0]
        for s in split_even(length, n):
            bounds.append(bounds[-1] + s)
    return [[[bounds[i], bounds[i + 1]], [bounds[n - 1 - i], bounds[n - i]]] for i in range(G)]


def contiguous_ranges(length: int, G: int) -> list[list[list[int]]]:
    """Cut ``[0, length)`` into G contiguous near-equal ranges (Ulysses, sequence parallelism)."""
    out, pos = [], 0
    for s in split_even(length, G):
        out.append([[pos, pos + s]])
        pos += s
    return out


def ranges_tokens(ranges: list[list[int]]) -> int:
    n = 0
    for s, e in ranges:  # (a loop: one or two ranges, where a generator costs more than the sum)
        n += e - s
    return n


def usp_ranges(length: int, u: int, r: int, scheme: str = "zigzag") -> list[list[list[int]]]:
    """Ranges of a usp (Ulysses x ring) group of ``u x r`` positions, row by row (position
    ``i*u + j``: row i, Ulysses position j). Row i holds the ring chunk(s) of ring position i
    (zigzag: chunks i and 2r-1-i of 2r; contiguous: the i-th of r), and Ulysses position j holds the
    j-th of u contiguous near-equal parts of each of the row's chunks."""
    if scheme not in ("zigzag", "contiguous"):
        raise ValueError(f"usp groups cut sequences zigzag or contiguous, not {scheme!r}")
    rows = zigzag_ranges(length, r) if scheme == "zigzag" else contiguous_ranges(length, r)
    out: list[list[list[int]]] = []
    for chunks in rows:
        parts = [[[s, s + n] for s, n in _cuts(a, b, u)] for a, b in chunks]
        out += [[p[j] for p in parts] for j in range(u)]
    return out


def _cuts(a: int, b: int, u: int) -> list[tuple[int, int]]:
    """``(start, size)`` of ``u`` contiguous near-equal parts of ``[a, b)``."""
    out, s = [], a
    for n in split_even(b - a, u):
        out.append((s, n))
        s += n
    return out


def merged_ranges(ranges) -> list[list[int]]:
    """Sorted, merged non-empty ``[start, end)`` ranges (a usp row's ring chunk from its positions')."""
    out: list[list[int]] = []
    for s, e in sorted((s, e) for s, e in ranges if e > s):
        if out and out[-1][1] == s:
            out[-1][1] = e
        else:
            out.append([s, e])
    return out
