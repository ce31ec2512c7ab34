"""Celery's Redis connections from a worker's own address (``osfarm worker --bind-address``).

Celery talks to Redis twice: the broker (kombu's redis transport: the queue, acks, the restore of
unacknowledged jobs) and the result backend (results, started states). Neither has a
source-address setting, but both take a connection class: kombu's channel from its
``connection_class`` attributes (and transport options it copies onto the channel), Celery's
backend from its connection parameters. The classes here put
:class:`osfarm.stream.redis_source.SourceBoundConnection` in both, with the address.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.backends.redis import RedisBackend
from kombu.transport import redis as kombu_redis

from osfarm.stream.redis_source import SourceBoundConnection, SourceBoundSSLConnection, bound_connection_class

OPTION = "source_address"  # the broker transport option (and the connection keyword)
APP_SETTING = "osfarm_source_address"  # the app setting the result backend reads


class SourceBoundChannel(kombu_redis.Channel):
    # kombu types these as its own exact values (a tuple of so many names, redis-py's classes)
    from_transport_options = (*kombu_redis.Channel.from_transport_options, OPTION)  # type: ignore[assignment]
    connection_class = SourceBoundConnection  # type: ignore[assignment]
    connection_class_ssl = SourceBoundSSLConnection
    source_address: str | None = None

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        params: dict[str, Any] = super()._connparams(asynchronous)
        # kombu subclasses our class for its event loop; a unix socket URL gets redis-py's own class
        if issubclass(params["connection_class"], SourceBoundConnection):
            if not self.source_address:
                raise ValueError(f"broker_transport_options: {OPTION} is required by {type(self).__name__}")
            params[OPTION] = self.source_address
        return params


class SourceBoundTransport(kombu_redis.Transport):
    Channel = SourceBoundChannel


class SourceBoundBackend(RedisBackend):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        address = self.app.conf.get(APP_SETTING)
        cls = bound_connection_class(self.connparams.get("connection_class"))
        if address and cls is not None:
            self.connparams.update(connection_class=cls, source_address=address)


def bind_app(app: Celery, broker: str, source_address: str) -> None:
    """Make ``app``'s broker and result backend connections leave from ``source_address``
    (the backend URL is the broker's, as :func:`osfarm.runner.executors.celery_app.make_app` sets it)."""
    if not broker.startswith(("redis://", "rediss://")):
        return  # a unix socket: no address to leave from
    backend = f"{SourceBoundBackend.__module__}:{SourceBoundBackend.__qualname__}"
    app.conf.update(broker_transport=SourceBoundTransport, result_backend=f"{backend}+{broker}",
                    broker_transport_options={**app.conf.broker_transport_options, OPTION: source_address},
                    **{APP_SETTING: source_address})
