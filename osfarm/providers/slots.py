"""Uid slots: each live sandbox box on this machine gets its own block of host uids.

A slot ``k`` owns host uids ``[base + k*STRIDE, base + (k+1)*STRIDE)``: the first 65536 are the
agent's user namespace (its root at the start, ``user`` at +1000), the next one is the guest's uid.
No two boxes on the machine share an id, whichever farm started them, so per-uid kernel limits
(inotify instances, user namespaces) are per box and no box's processes match another's uid.

Slots are held with ``flock`` on ``/run/osfarm-slots/<k>.lock`` for as long as the box lives (a
farm that dies releases them with its fds). The default base is above the ranges that systemd
gives containers (0x80000-0x6fffffff), so host accounts and other container managers never
own these ids.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from osfarm.desktop.box.agent_world import ID_COUNT
from osfarm.providers.base import ProviderError

STRIDE = 2 * ID_COUNT
DEFAULT_BASE = 0x70000000
MAX_ID = 0xFFFFFFFE  # (uid_t)-1 is "no id"
SLOT_DIR = Path("/run/osfarm-slots")


@dataclass(frozen=True)
class Slot:
    index: int
    agent_base: int  # host uid/gid of the agent's root (box uid 0)
    guest_uid: int
    fd: int

    def agent_id(self, box_id: int) -> int:
        """The host id of the agent's box uid/gid ``box_id``."""
        return self.agent_base + box_id


class SlotPool:
    """Hands out slots of this machine (see the module doc)."""

    def __init__(self, base: int = DEFAULT_BASE, slot_dir: Path = SLOT_DIR):
        self.base = base
        self.slot_dir = slot_dir
        self.count = min(4096, (min(MAX_ID, 0x7FFFFFFF) - base) // STRIDE)
        if base < 1 or self.count < 1:
            raise ProviderError(f"sandbox_uid_base {base}: no room for uid slots below {0x7FFFFFFF:#x}")
        slot_dir.mkdir(mode=0o755, parents=True, exist_ok=True)

    def slot(self, index: int, fd: int) -> Slot:
        first = self.base + index * STRIDE
        return Slot(index=index, agent_base=first, guest_uid=first + ID_COUNT, fd=fd)

    def acquire(self, prefer: int | None = None) -> Slot:
        """The first free slot (``prefer`` first); raises ProviderError when all are held."""
        order = range(self.count) if prefer is None else [prefer, *(i for i in range(self.count) if i != prefer)]
        for i in order:
            fd = os.open(self.slot_dir / f"{i}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return self.slot(i, fd)
        raise ProviderError(f"all {self.count} sandbox uid slots of this machine are in use ({self.slot_dir})")

    @staticmethod
    def release(slot: Slot) -> None:
        with contextlib.suppress(OSError):
            os.close(slot.fd)
