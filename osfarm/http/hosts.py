"""Which addresses an osfarm server may listen on without being told the network is trusted."""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback addresses (the only places our servers may listen)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
