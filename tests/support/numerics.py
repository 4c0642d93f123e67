"""The one way the tests compare a computed tensor with its reference.

"Within 1e-5" means the same thing in every test file::

    rel_err(got, ref) = max|got - ref| / max(max|ref|, TINY)

the largest element-wise difference, relative to the reference's largest magnitude (both in
float64). It is scale-aware (a tensor of values around 1e3 is allowed differences around 1e-2 at
1e-5) but, unlike a norm-wise measure, one bad element cannot hide among many good ones. ``TINY``
only avoids a division by zero: an all-zero reference is matched only by (almost) exact zeros.

A caller that knows a better scale than the tensor's own largest value passes ``scale=``: for
example a reference that is exactly zero (a one-token sequence's dq and dk) judged against the
inputs' unit scale, where any rounding noise would otherwise count as an infinite error.

:func:`max_abs_errs` is the absolute counterpart, for checks stated in absolute terms (inputs of
unit scale: "every output and gradient within 1e-5") and for comparing errors with each other (a
bf16 ring's error against single-process bf16's).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TINY", "assert_matches_reference", "max_abs_errs", "rel_err"]

TINY = 1e-30


def _f64(x: Any):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64)
    return torch.as_tensor(x, dtype=torch.float64)


def rel_err(got: Any, ref: Any, *, scale: float | None = None) -> float:
    """``max|got - ref| / max(scale, TINY)``, ``scale`` defaulting to ``max|ref|``.

    Tensors (or anything ``torch.as_tensor`` takes) of the same shape; computed in float64. An
    empty pair has error 0. A NaN anywhere makes the error NaN (which fails every ``<= tol``).
    """
    a, b = _f64(got), _f64(ref)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    if b.numel() == 0:
        return 0.0
    if scale is None:
        scale = float(b.abs().max())
    diff = (a - b).abs().max()
    return float(diff) / max(float(scale), TINY)


def assert_matches_reference(got: Any, ref: Any, tol: float, what: str = "", *, scale: float | None = None) -> float:
    """Assert ``rel_err(got, ref, scale=scale) <= tol`` (same shapes, nothing NaN); return the error.

    The failure message names ``what``, the error, the tolerance, the scale and the worst element.
    """
    a, b = _f64(got), _f64(ref)
    label = f"{what}: " if what else ""
    assert a.shape == b.shape, f"{label}shape {tuple(a.shape)} != reference {tuple(b.shape)}"
    err = rel_err(a, b, scale=scale)
    if not err <= tol:  # also catches NaN
        s = float(b.abs().max()) if scale is None and b.numel() else scale
        flat = (a - b).abs().flatten()
        i = int(flat.nan_to_num(nan=float("inf")).argmax())
        idx = tuple(int(j) for j in _unravel(i, tuple(a.shape)))
        raise AssertionError(
            f"{label}relative error {err:.3g} > {tol:g} (max|got - ref| / {s:.3g}); worst at {idx}: "
            f"got {float(a.flatten()[i]):.9g}, reference {float(b.flatten()[i]):.9g}"
        )
    return err


def max_abs_errs(got, ref) -> list[float]:
    """``[max|g - r| for g, r in zip(got, ref)]`` in float64: one absolute error per pair of tensors
    (sequences of the same length; a pair's shapes must match)."""
    got, ref = list(got), list(ref)
    if len(got) != len(ref):
        raise ValueError(f"{len(got)} tensors vs {len(ref)} references")
    out = []
    for g, r in zip(got, ref):
        a, b = _f64(g), _f64(r)
        if a.shape != b.shape:
            raise ValueError(f"shapes differ: {tuple(a.shape)} vs reference {tuple(b.shape)}")
        out.append(float((a - b).abs().max()) if b.numel() else 0.0)
    return out


def _unravel(i: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return out[::-1]
