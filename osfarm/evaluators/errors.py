"""Errors of the evaluators: a task's evaluator configuration that cannot be honoured.

Both are raised, never scored 0: the fault is in the task (or a gap in osfarm), not the agent's.
"""

from __future__ import annotations

from osfarm.errors import OsfarmError


class UnsupportedOption(OsfarmError, RuntimeError):
    """A task's evaluator asks for a rule, method or file type that osfarm does not know: a bug
    in the task (or a gap to fill), never the agent's failure, so it is raised, not scored 0."""


class RuleError(OsfarmError, ValueError):
    """A rule of the task's evaluator is malformed (an unknown rule ``type``, a key of the wrong
    shape)."""
