"""Plan files edited on purpose: records written back with a fresh end record.

A plan of the current format must end with the digest of its records, so an edit that leaves the
old end record (or none) is refused as "edited" or "truncated" before any structural check. The
tests of the structural checks (coverage, ring order, ...) edit a record and re-seal the file, as
a writer that recomputes the digest would, so that the check they test is the one that refuses it.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["sealed"]


def sealed(records: list[dict]) -> str:
    """JSON-lines text of ``records`` (header first, steps after; any end record among them is
    dropped) followed by the end record of exactly these bytes."""
    from zeppelin.schemas.plan import end_record

    lines = "".join(json.dumps(r) + "\n" for r in records if r.get("kind") != "end")
    return lines + end_record(lines.count("\n") - 1, hashlib.sha256(lines.encode()))
