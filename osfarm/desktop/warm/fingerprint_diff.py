"""Where two desktop fingerprints (:mod:`osfarm.desktop.warm.fingerprint`) differ.

The farm's side of a warm reset needs only this, not the guest's X and /proc readers: standard
library only, so the farm does not load python-xlib to compare two JSON documents.
"""

from __future__ import annotations

import json
from typing import Any


def differences(a: dict[str, Any], b: dict[str, Any], limit: int = 8) -> list[str]:
    """Where two fingerprints differ, as short paths (for the log and the fallback's reason)."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if len(out) >= limit or x == y:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{path}.{k}" if path else k)
        elif isinstance(x, list) and isinstance(y, list) and path.count(".") < 2:
            sx = {json.dumps(e, sort_keys=True) for e in x}
            sy = {json.dumps(e, sort_keys=True) for e in y}
            for e in sorted(sx - sy)[:3]:
                out.append(f"{path}: only before {e[:160]}")
            for e in sorted(sy - sx)[:3]:
                out.append(f"{path}: only after {e[:160]}")
            if sx == sy:
                out.append(f"{path}: order")
        else:
            out.append(f"{path}: {json.dumps(x)[:120]} != {json.dumps(y)[:120]}")

    skip = ("digest", "timings_ms")
    walk({k: v for k, v in a.items() if k not in skip}, {k: v for k, v in b.items() if k not in skip}, "")
    return out[:limit]
