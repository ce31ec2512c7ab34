"""A free TCP port on the loopback interface, for a server a test or bench is about to start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick; another process may take it before the
    caller binds it, which on a test machine is rare enough)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
