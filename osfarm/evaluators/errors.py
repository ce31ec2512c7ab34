"""Errors of the evaluators."""

from __future__ import annotations


class UnsupportedOption(RuntimeError):
    """A task's evaluator asks for a rule, method or file type that osfarm does not know: a bug
    in the task (or a gap to fill), never the agent's failure, so it is raised, not scored 0."""
