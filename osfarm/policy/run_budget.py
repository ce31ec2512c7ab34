"""A training run's budget as a policy server's settings: the screenshot resize bounds and the
context limit that ``osfarm policy serve`` and the vLLM command line take from train.yaml's
``budget`` (``--train-config``), so the server resizes screenshots as the agent maps coordinates
and the learner rebuilds prompts. A flag given beside the file may only repeat what the file
says: one that disagrees is refused by name, never silently preferred (two resize settings in
one run skew every importance weight without an error anywhere).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from osfarm.config import read_yaml_mapping, yaml_line
from osfarm.errors import OsfarmError
from osfarm.schema.budget import Budget


class BudgetError(OsfarmError, ValueError):
    """train.yaml's budget cannot be read, or a flag disagrees with it (the message names both)."""


class ServerBudget(BaseModel):
    """What a policy server takes of a budget (None: the server's own default)."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    max_model_len: int | None = None

    @classmethod
    def of(cls, budget: Budget) -> ServerBudget:
        return cls(min_pixels=budget.min_pixels, max_pixels=budget.max_pixels, max_model_len=budget.max_model_len)

    def serve_args(self) -> list[str]:
        """``osfarm policy serve`` flags (a spawned server's)."""
        out: list[str] = []
        for name, value in self.model_dump().items():
            if value is not None:
                out += [f"--{name.replace('_', '-')}", str(value)]
        return out


# where each setting comes from in train.yaml, for the refusal's message
_SOURCE = {"min_pixels": "budget.min_pixels", "max_pixels": "budget.max_pixels",
           "max_model_len": "budget.max_prompt_tokens + budget.max_response_tokens"}


def read_budget(path: Path) -> Budget:
    """train.yaml's ``budget`` (an empty one when the file has none); errors name ``FILE:LINE``."""
    data, text = read_yaml_mapping(path, BudgetError)
    raw = data.get("budget") or {}
    if not isinstance(raw, dict):
        raise BudgetError(f"{path}:{yaml_line(text, ('budget',))}: budget: expected a mapping")
    try:
        return Budget.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ("budget", *(str(p) for p in err["loc"]))
        raise BudgetError(f"{path}:{yaml_line(text, loc)}: {'.'.join(loc)}: {err['msg']}") from None


def server_budget(train_config: Path | None, flags: ServerBudget) -> ServerBudget:
    """The settings a server runs with: train.yaml's budget where it sets them, else the flags;
    a flag given with a different value than the file's is refused (:class:`BudgetError`)."""
    if train_config is None:
        return flags
    from_file = ServerBudget.of(read_budget(train_config))
    merged = {}
    for name, given in flags.model_dump().items():
        wanted = getattr(from_file, name)
        if given is not None and wanted is not None and given != wanted:
            raise BudgetError(f"--{name.replace('_', '-')} {given} disagrees with {train_config}'s {_SOURCE[name]} "
                              f"({wanted}); set it once, in train.yaml's budget")
        merged[name] = wanted if wanted is not None else given
    return ServerBudget(**merged)
