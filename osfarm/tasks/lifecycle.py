"""The steps of one OSWorld task on one desktop, written once: setup, postconfig, evaluation.

Everything that runs a task calls these: :class:`osfarm.env.TaskEnv` (and through it the runner,
the Celery worker, the trainer and the benches) and the farm's task routes
(``POST /v1/desktops/{id}/reset|evaluate``). They are synchronous (the guest calls go through the
blocking :class:`GuestController`); async callers run them in a worker thread.

Failures are the harness's, never the agent's: a setup or postconfig step that fails raises
:class:`SetupFailed` (its index, type and reason; an offline asset that is not in the cache is its
``__cause__``), a getter or metric that crashes raises :class:`EvaluationError`, and a guest that
cannot be reached raises :class:`GuestError`. Callers decide what that becomes (an ``infra_error``
episode, a 4xx/5xx answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osfarm.errors import OsfarmError
from osfarm.evaluators.getters import GETTERS
from osfarm.evaluators.getters.env import EvalEnv
from osfarm.evaluators.metrics import METRICS
from osfarm.evaluators.scoring import score as score_fn
from osfarm.tasks.controller import GuestController
from osfarm.tasks.filecache import AssetMissing, FileCache
from osfarm.tasks.model import Task
from osfarm.tasks.setup import POSTCONFIG_WINDOW_S, SetupExecutor, StepReport


class EvaluationError(OsfarmError):
    """A getter or metric crashed, or the evaluator names an unknown getter: the harness failed,
    not the agent (the message names which)."""


@dataclass
class TaskRun:
    """One task on one desktop: what its setup, postconfig and evaluation need.

    ``work_dir`` is the run's own folder: the getters write the files they fetch there and the
    ``execute`` steps their ``stdout``/``stderr`` (OSWorld's ``cache_dir``). Without one, setup
    outputs go to the file cache's folder of the task and evaluation needs one.
    """

    task: Task
    controller: GuestController
    cache: FileCache
    screen: tuple[int, int]
    offline: bool = True
    work_dir: Path | None = None

    def executor(self) -> SetupExecutor:
        return SetupExecutor(self.controller, self.cache, self.task.id, self.screen, offline=self.offline,
                             output_dir=self.work_dir)


class CacheLookup:
    """``EvalEnv.offline_cache`` over a FileCache: ``lookup(url, name) -> Path | None``."""

    def __init__(self, cache: FileCache, task_id: str, offline: bool):
        self.cache, self.task_id, self.offline = cache, task_id, offline

    def lookup(self, url: str, name: str | None = None) -> Path | None:
        try:
            return self.cache.fetch(url, self.task_id, name=name, offline=self.offline)
        except AssetMissing:
            return None


def task_label(task: Task) -> str:
    """How errors name the task's file: its path, or its id when it came without one (an API body)."""
    return str(task.path) if task.path is not None else f"task {task.id}"


def run_setup(run: TaskRun) -> list[StepReport]:
    """Run the task's ``config`` steps in order (raises SetupFailed at the first failing one)."""
    return run.executor().run(run.task.config, where=f"{task_label(run.task)}: $.config")


def run_postconfig(run: TaskRun) -> list[StepReport]:
    """Run ``evaluator.postconfig`` (raises SetupFailed). Its window waits are short: the windows
    it activates are the ones the agent left open, not apps still starting."""
    setup = run.executor()
    setup.window_timeout = POSTCONFIG_WINDOW_S
    return setup.run(run.task.evaluator.postconfig, where=f"{task_label(run.task)}: $.evaluator.postconfig")


def evaluate(run: TaskRun, last_action: Any) -> float:
    """Run the evaluator's getters and metric; the score in [0, 1].

    ``last_action`` is the agent's last action (``"FAIL"`` or ``{"action_type": "FAIL"}`` is what
    scores an infeasible task). Raises EvaluationError for a crash, GuestError for a guest that
    cannot be reached (also where a getter swallowed it: see ``GuestController.unreachable``).
    """
    task = run.task
    ev = task.evaluator
    evaluator = ev.to_json()
    if ev.is_infeasible:
        return float(score_fn(evaluator, [], [], last_action, METRICS))
    if run.work_dir is None:
        raise ValueError("evaluate: the run needs a work_dir for the files its getters fetch")
    env = EvalEnv(controller=run.controller, cache_dir=run.work_dir, task_id=task.id,
                  offline_cache=CacheLookup(run.cache, task.id, run.offline), screen=run.screen)

    def get(spec: Any) -> Any:
        if spec is None:
            return None
        cfg = spec if isinstance(spec, dict) else spec.to_json()
        typ = cfg.get("type")
        fn = GETTERS.get(typ) if isinstance(typ, str) else None
        if fn is None:
            raise EvaluationError(f"evaluation: unknown getter {typ!r}")
        try:
            return fn(env, cfg)
        except Exception as e:
            raise EvaluationError(f"evaluation: getter {typ!r} crashed: {type(e).__name__}: {e}") from e

    gone = len(run.controller.unreachable)
    if isinstance(ev.func, list):
        # Metric i gets entry i; entries past len(func) are never fetched (OSWorld's indexing).
        result, expected = ev.aligned("result"), ev.aligned("expected")
        results = [get(x) for x in result] if isinstance(result, list) else []
        expecteds = [get(x) for x in expected] if isinstance(expected, list) else []
    else:
        results = [get(ev.result)]
        expecteds = [get(ev.expected)] if ev.expected is not None else []
    if len(run.controller.unreachable) > gone:
        # A getter that could not reach the desktop returns None (OSWorld's way), which its metric
        # scores 0: that zero would be the harness's failure counted as the agent's.
        raise run.controller.unreachable[gone]
    try:
        return float(score_fn(evaluator, results, expecteds, last_action, METRICS))
    except Exception as e:
        raise EvaluationError(f"evaluation: metric {ev.func!r} crashed: {type(e).__name__}: {e}") from e
