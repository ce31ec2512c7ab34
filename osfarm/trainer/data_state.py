"""The data manager's checkpoint file: its schema, writing it whole, reading it back checked.

A trainer resumed from a checkpoint must see the task statistics, pending episodes and seen ids
it saved, or it would retrain episodes or lose them; a file cut short by a crash, or written by
another version of this reader, is therefore refused with a message instead of half-read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATE_SCHEMA = "osfarm.data_manager/1"
STATE_FILE = "data_manager.json"


def atomic_write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader never sees it half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """The state saved in ``state_dir`` (None when there is none)."""
    p = Path(state_dir) / STATE_FILE
    if not p.is_file():
        return None
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise ValueError(f"{p}: not JSON ({e}); delete it to start the data manager afresh") from None
    if d.get("schema") != STATE_SCHEMA:
        raise ValueError(f"{p}: schema {d.get('schema')!r}, this reader knows {STATE_SCHEMA}")
    return d
