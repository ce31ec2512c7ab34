"""osfarm's error hierarchy: every exception osfarm defines derives from :class:`OsfarmError`.

Two branches decide how an episode ends, and the runner tells them apart with ``isinstance``
(never by an attribute looked up by name)::

    OsfarmError
    ├── InfraError       the harness failed, not the agent: the episode is recorded as infra_error
    │                    (and may be retried): no desktop, a failed setup step, an unreachable
    │                    farm, guest or policy server, a crashed worker
    └── EpisodeTimeout   the episode's time limit ran out: recorded as timeout (a TimeoutError too)

Any other ``OsfarmError`` is neither: a bad request or task file, an agent's unparseable reply,
a wrong setting. Each class keeps its built-in base as well (``RuntimeError``, ``ValueError``,
``ConnectionError``, ...), so code that catches those still catches it.

An agent (or anything the runner calls on the agent's behalf) that wants a failure counted as the
harness's raises an :class:`InfraError` subclass. This module imports nothing of osfarm: every
layer may import it.
"""

from __future__ import annotations


class OsfarmError(Exception):
    """The base of every exception osfarm defines."""


class InfraError(OsfarmError):
    """The harness failed, not the agent: no desktop, a failed setup or postconfig step, a desktop
    that died or cannot be reached, a crashing getter or metric, a policy server that stays down.
    The message says which; ``phase``, where the task env raised it, says where (``lease``,
    ``setup``, ``observe``, ``step``, ``evaluate``, ``agent``; None elsewhere). A benchmark counts
    such an episode as ``infra_error`` (and may retry it), never as the agent's failure."""

    phase: str | None = None

    def __init__(self, *args: object, phase: str | None = None) -> None:
        super().__init__(*args)
        if phase is not None:
            self.phase = phase


class EpisodeTimeout(OsfarmError, TimeoutError):
    """The episode's time limit ran out (in :meth:`osfarm.env.TaskEnv.reset` or
    :meth:`~osfarm.env.TaskEnv.evaluate`, or a Celery worker's hard time limit)."""


__all__ = ["EpisodeTimeout", "InfraError", "OsfarmError"]
