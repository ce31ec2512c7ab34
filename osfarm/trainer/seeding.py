"""XRPO's in-context seeding: a task with no success yet gets a solved related task as an exemplar.

GRPO learns nothing from a task whose every rollout fails (all advantages are 0). XRPO breaks the
stall by putting a solved example in the prompt of some of that task's rollouts. Here the example
is a successful episode from the experience pool of a *related* task (same domain first, then the
most instruction words in common; never the task itself, which has no success), written as its
instruction and the actions that solved it, appended to the seeded rollout's instruction. The
episode record keeps the prompt the agent really sent, so the learner trains on exactly what the
policy saw.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

EXEMPLAR_HEADER = "\n\nExample of a solved related task:"
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class TaskInfo:
    task_id: str
    domain: str
    instruction: str


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) > 2}


def related_tasks(task: TaskInfo, candidates: Sequence[TaskInfo]) -> list[TaskInfo]:
    """``candidates`` (not ``task``) by relatedness: same domain first, then Jaccard overlap of the
    instructions' words, then id (a stable order)."""
    mine = _words(task.instruction)

    def key(c: TaskInfo) -> tuple[int, float, str]:
        theirs = _words(c.instruction)
        overlap = len(mine & theirs) / len(mine | theirs) if mine | theirs else 0.0
        return (0 if c.domain == task.domain else 1, -overlap, c.task_id)

    return sorted((c for c in candidates if c.task_id != task.task_id), key=key)


def exemplar_text(instruction: str, record: Mapping[str, Any], *, max_chars: int = 2000) -> str:
    """A solved episode as prompt text: its task and, step by step, what the agent did."""
    lines = [EXEMPLAR_HEADER, f"Task: {instruction}"]
    for st in record.get("steps", []):
        actions = st.get("actions") or []
        shown = "; ".join(a if isinstance(a, str) else str(a) for a in actions)
        lines.append(f"Step {st.get('index')}: {shown}")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max_chars - 4] + " ..."


def pick_exemplar(task: TaskInfo, tasks: Mapping[str, TaskInfo], solved: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The exemplar for ``task`` from ``solved`` (task id -> a successful episode record), or None
    when no related task has been solved."""
    for c in related_tasks(task, [tasks[t] for t in solved if t in tasks]):
        return exemplar_text(c.instruction, solved[c.task_id])
    return None
