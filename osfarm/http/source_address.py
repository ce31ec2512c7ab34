"""The local address a process's outgoing connections leave from (``osfarm worker --bind-address``).

A worker host of a cluster may have several addresses (a private and a public interface; on one
machine, 127.0.0.2 and 127.0.0.3 for two "hosts"), and the kernel picks the source by its route
table, not by the host's role: a worker that should reach its farm, its policy servers and Redis
from its cluster-side address (what firewalls, Redis's ``CLIENT LIST`` and the farm's access log
see) binds its sockets to it. The address is this process's setting, kept in the environment
(``OSFARM_SOURCE_ADDRESS``) so that the worker's forked pool processes have it too; the HTTP
clients (farm, policy) read it here, the Redis connections in ``osfarm.stream.redis_source``.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

import httpx

from osfarm.errors import OsfarmError

ENV = "OSFARM_SOURCE_ADDRESS"


class SourceAddressError(OsfarmError, ValueError):
    """The address given cannot be a source address of this machine; the message names the option."""


def check_source_address(address: str, option: str) -> str:
    """``address`` if it is one of this machine's addresses (a socket can bind it), else
    :class:`SourceAddressError` naming ``option``. A wildcard (0.0.0.0, ::) is refused: it binds
    nothing in particular, which is what not giving the option already does."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise SourceAddressError(f"{option}: {address!r} is not an IP address") from None
    if ip.is_unspecified:
        raise SourceAddressError(f"{option}: {address} is the wildcard address; give one of this machine's "
                                 "addresses (or leave the option out)")
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(ip), 0))
        except OSError as e:
            why = "not an address of this machine" if e.errno == errno.EADDRNOTAVAIL else e.strerror
            raise SourceAddressError(f"{option}: {address}: {why}") from None
    return str(ip)


def set_source_address(address: str, option: str) -> str:
    """Check ``address`` and make it this process's (and its children's) source address."""
    os.environ[ENV] = check_source_address(address, option)
    return os.environ[ENV]


def source_address() -> str | None:
    """This process's source address, or None (the kernel picks one per connection)."""
    return os.environ.get(ENV) or None


def async_transport(local_address: str | None = None) -> httpx.AsyncHTTPTransport | None:
    """An httpx transport whose connections leave from ``local_address`` (default: the process's
    source address); None when there is none, so the client keeps httpx's own default."""
    addr = local_address or source_address()
    return httpx.AsyncHTTPTransport(local_address=addr) if addr else None


def sync_transport(local_address: str | None = None) -> httpx.HTTPTransport | None:
    """:func:`async_transport` for a blocking client."""
    addr = local_address or source_address()
    return httpx.HTTPTransport(local_address=addr) if addr else None
