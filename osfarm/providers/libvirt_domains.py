"""The blocking libvirt calls on one farm's domains: look one up, destroy it, find its qemu
process, list the domains that carry osfarm's metadata.

Every call blocks: the provider makes each through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import psutil

from osfarm.providers.libvirt_domain_xml import read_metadata


class Domains:
    """Domains through one libvirt connection (``lv``: the libvirt module, imported lazily by the
    provider; ``conn``: its connection)."""

    def __init__(self, lv: Any, conn: Any):
        self.lv = lv
        self.conn = conn

    def lookup(self, name: str) -> Any | None:
        try:
            return self.conn.lookupByName(name)
        except self.lv.libvirtError as e:
            if e.get_error_code() == self.lv.VIR_ERR_NO_DOMAIN:
                return None
            raise

    def destroy(self, name: str) -> None:
        dom = self.lookup(name)
        if dom is None:
            return
        with contextlib.suppress(self.lv.libvirtError):
            dom.destroy()
        # Persistent domains (defined by someone by hand) would stay listed: undefine them too.
        with contextlib.suppress(self.lv.libvirtError):
            if dom.isPersistent():
                dom.undefineFlags(self.lv.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)

    def is_active(self, name: str) -> bool:
        dom = self.lookup(name)
        try:
            return bool(dom is not None and dom.isActive())
        except self.lv.libvirtError:
            return False

    @staticmethod
    def qemu_pid(name: str) -> int | None:
        """qemu's pid, from libvirt's pid file (qemu:///system) or the process table."""
        for path in (Path("/run/libvirt/qemu") / f"{name}.pid", Path.home() / f".cache/libvirt/qemu/run/{name}.pid"):
            with contextlib.suppress(OSError, ValueError):
                return int(path.read_text().strip())
        for p in psutil.process_iter(["name", "cmdline"]):
            cmd = p.info["cmdline"] or []
            if p.info["name"] and p.info["name"].startswith("qemu") and f"guest={name}," in " ".join(cmd):
                return p.pid
        return None

    def osfarm_domains(self) -> list[tuple[str, dict[str, str]]]:
        """(name, osfarm metadata) of every domain that has our metadata, any farm's."""
        out = []
        for dom in self.conn.listAllDomains(0):
            try:
                meta = read_metadata(dom.XMLDesc(0))
            except self.lv.libvirtError:
                continue  # vanished meanwhile
            if meta is not None:
                out.append((dom.name(), meta))
        return out
