"""A farm process bound to a loopback address of its own: one "host" of a cluster on one machine
(127.0.0.2, 127.0.0.3, ...: the network rule keeps test traffic inside 127.0.0.0/8)."""

from __future__ import annotations

from pathlib import Path

from osfarm.testing.farm_process import FarmProcess


class HostFarm(FarmProcess):
    def __init__(self, host: str, state_dir: Path, desktops: int = 2, warm: int = 1):
        if not host.startswith("127."):
            raise ValueError(f"host {host!r}: a test farm binds a loopback address (127.0.0.0/8) only")
        super().__init__(state_dir, pool_min=min(warm, desktops), pool_max=desktops, width=800, height=600)
        self.host = host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        return [*super()._argv(), "--host", self.host]
