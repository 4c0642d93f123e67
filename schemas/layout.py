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
    sizes = split_even(length, 2 * G)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return [[[bounds[i], bounds[i + 1]], [bounds[2 * G - 1 - i], bounds[2 * G - i]]] for i in range(G)]


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
