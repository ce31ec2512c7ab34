"""Reward shaping: an episode's training reward from its score and how it got there.

Off by default (both penalties 0: the reward is the evaluator's score). A parse-error penalty
teaches the output format (a reply the agent cannot parse is a wasted step that a 0/1 score only
punishes when it costs the task); a step penalty prefers the shorter of two solutions. The task's
success statistics (the allocator, dynamic length, the curriculum) keep the unshaped score.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PARSE_ERROR_PREFIX = "parse error"  # how the runner records a reply that gave no action (runner/episode.py)


def parse_errors(steps: Sequence[Mapping[str, Any]]) -> int:
    """Steps of a record whose model reply did not parse."""
    return sum(1 for s in steps if str(s.get("action_error") or "").startswith(PARSE_ERROR_PREFIX))


def shaped_reward(score: float, steps: Sequence[Mapping[str, Any]], *, parse_error_penalty: float = 0.0,
                  step_penalty: float = 0.0) -> float:
    """``score`` less ``parse_error_penalty`` per unparsable reply and ``step_penalty`` per step."""
    if parse_error_penalty < 0 or step_penalty < 0:
        raise ValueError(f"reward shaping penalties must be >= 0, got parse_error_penalty={parse_error_penalty}, "
                         f"step_penalty={step_penalty}")
    return score - parse_error_penalty * parse_errors(steps) - step_penalty * len(steps)
