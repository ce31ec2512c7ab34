"""The Celery app and its one task, ``osfarm.run_episode`` (an episode on the worker's farm).

Delivery guarantees (Redis broker and result backend):
* ``acks_late`` + ``reject_on_worker_lost``: a message is acknowledged only when its episode has
  finished, so a worker that dies mid-episode (``kill -9``, a lost machine) gives its episode to
  another worker: at once when the pool child died, after ``visibility_timeout`` when the whole
  worker died (Redis then restores the unacknowledged message).
* prefetch 1: a worker holds only the episodes it is running.
* per-task soft/hard time limits from the episode's own limit; the visibility timeout must be
  longer than the hard limit, or Redis would hand a still-running episode to a second worker
  (the runner refuses such a configuration).
* idempotent episodes: the episode id is uuid5(run, task), the same on every delivery. A worker
  takes a claim key (SET NX, renewed while it runs, gone soon after a crash) before running, and
  stores the finished result and publishes the record in one atomic step. A redelivered message
  whose result exists returns it without running again; one whose claim is held waits for that
  run. So a redelivered episode never yields two records (worker_task.py).
* a redelivery cap: a job that keeps killing its worker (out of memory) is not run forever; after
  OSFARM_MAX_DELIVERIES starts it ends as an infra_error with the reason, dead-lettered.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from osfarm.runner.episode import EpisodeConfig
from osfarm.runner.executors.celery_source import bind_app
from osfarm.runner.executors.worker_task import run_job

TASK_NAME = "osfarm.run_episode"
QUEUE = "osfarm.episodes"
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"


def visibility_timeout_s() -> float:
    """Seconds before Redis hands an unacknowledged episode to another worker (OSFARM_CELERY_VISIBILITY_S)."""
    return float(os.environ.get("OSFARM_CELERY_VISIBILITY_S", "7200"))


def restore_interval_s() -> float:
    """How often a worker looks for messages whose visibility timeout ran out (OSFARM_CELERY_RESTORE_S)."""
    return float(os.environ.get("OSFARM_CELERY_RESTORE_S", "10"))


def hard_limit_s(time_limit_s: float, infra_retries: int) -> float:
    """The task's hard limit: every attempt may use its whole limit (lease and setup included),
    the longest backoff before each retry, plus 30 s to write the task's files and publish its record."""
    base = EpisodeConfig().retry_backoff_s
    waits = sum(min(60.0, base * 2 ** i) for i in range(infra_retries))
    return time_limit_s * (infra_retries + 1) + waits + 30.0


def soft_limit_s(time_limit_s: float, infra_retries: int) -> float:
    return hard_limit_s(time_limit_s, infra_retries) - 15.0


def make_app(broker: str, source_address: str | None = None) -> Celery:
    """The app on ``broker`` (also its result backend); ``source_address``: every Redis connection
    leaves from it (a worker bound to its host's address)."""
    vis = visibility_timeout_s()
    transport = {"visibility_timeout": vis, "unacked_restore_interval": restore_interval_s(),
                 "unacked_restore_throttle": 1}
    app = Celery("osfarm", broker=broker, backend=broker)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=QUEUE,
        task_track_started=True,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a restarted Redis: keep trying
        result_backend_always_retry=True,
        result_backend_max_retries=60,
        result_expires=7 * 24 * 3600,
        worker_cancel_long_running_tasks_on_connection_loss=False,  # results are idempotent: let them finish
        worker_hijack_root_logger=False,
    )
    if source_address:
        bind_app(app, broker, source_address)
    app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True)(_run_episode_task)
    return app


def _run_episode_task(self: Any, **job: Any) -> dict[str, Any]:
    return run_job(job, worker_name=getattr(self.request, "hostname", None) or "worker")
