"""OSWorld-compatible tasks: the task model, suites, and coverage of what they need.

Kept import-light on purpose: ``osfarm.tasks.setup`` (built separately) lives in this package.
"""

from osfarm.tasks.model import (
    ConfigStep,
    Evaluator,
    Getter,
    Issue,
    Task,
    TaskError,
    load_task,
    parse_task,
)
from osfarm.tasks.suite import RefusedTask, Suite, load_suite

__all__ = [
    "ConfigStep",
    "Evaluator",
    "Getter",
    "Issue",
    "RefusedTask",
    "Suite",
    "Task",
    "TaskError",
    "load_suite",
    "load_task",
    "parse_task",
]
