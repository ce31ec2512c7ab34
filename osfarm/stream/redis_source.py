"""Redis connections that leave from a chosen local address (a worker bound to its host's address).

redis-py has no source-address setting: its TCP connection makes the socket and connects it in
one method. :class:`SourceBoundConnection` makes the socket with ``socket.create_connection``'s
``source_address`` and then sets what redis-py's own does (no Nagle, keepalive and its options,
the read timeout). It takes ``source_address`` as a connection keyword, so a pool, kombu's
broker channel and Celery's result backend hand it over with their other connection settings.
"""

from __future__ import annotations

import socket
from typing import Any

import redis


class SourceBoundConnection(redis.Connection):
    def __init__(self, *, source_address: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.source_address = source_address

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self.socket_connect_timeout,
                                        source_address=(self.source_address, 0))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.socket_keepalive:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for k, v in self.socket_keepalive_options.items():
                    sock.setsockopt(socket.IPPROTO_TCP, k, v)
            sock.settimeout(self.socket_timeout)
        except OSError:
            sock.close()
            raise
        return sock


class SourceBoundSSLConnection(redis.SSLConnection, SourceBoundConnection):
    """TLS over a source-bound socket (``rediss://``): SSLConnection wraps what our ``_connect`` made."""


def bound_connection_class(current: type[redis.connection.AbstractConnection] | None) -> type[Any] | None:
    """The source-bound class that stands for ``current`` (what a URL chose: None or plain TCP,
    TLS), or None for a connection that has no source address (a unix socket)."""
    if current is not None and issubclass(current, SourceBoundConnection):
        return current
    if current is None or current is redis.Connection:
        return SourceBoundConnection
    if issubclass(current, redis.SSLConnection):
        return SourceBoundSSLConnection
    return None
