"""Which trainable parameters a rank's forward passes reached since the last clear.

On one rank a parameter that no forward pass of a minibatch used gets no gradient (``grad``
None) and AdamW leaves it alone: the vision tower of a minibatch without a screenshot. Under
FSDP2 every rank joins the reduce-scatter with zeros for what it did not use, so every
parameter comes out of the backward pass with a gradient, and the optimizer would step the
tower on a zero gradient (weight decay, the moments' decay, the step count). The unsharded
gradients that say which parameters a rank used live inside FSDP2; what a rank can see is
which modules ran. A parameter counts as reached when a module that holds it (tied ones have
several) ran a forward pass with gradients on; ``distributed.drop_unreached_grads`` then asks
the other ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class ForwardReach:
    """Forward hooks on the modules of ``model`` that hold one of ``params`` directly."""

    def __init__(self, model: Any, params: Sequence[torch.nn.Parameter]):
        wanted = {id(p): i for i, p in enumerate(params)}
        self._holders: list[list[int]] = [[] for _ in params]  # per parameter, the modules holding it
        self._ran: set[int] = set()
        self._hooks = []
        for m in model.modules():
            held = [wanted[id(p)] for p in m.parameters(recurse=False) if id(p) in wanted]
            if not held:
                continue
            for i in held:
                self._holders[i].append(id(m))
            self._hooks.append(m.register_forward_hook(self._record))

    def _record(self, module: Any, _args: Any, _out: Any) -> None:
        # a pass without gradients (the proximal log-probs) reaches nothing that trains; a
        # checkpointed layer is run again with them in the backward pass, before anyone asks
        if torch.is_grad_enabled():
            self._ran.add(id(module))

    def clear(self) -> None:
        self._ran.clear()

    def reached(self) -> list[bool]:
        """Per parameter (in the order given), whether a module holding it ran since :meth:`clear`."""
        return [any(m in self._ran for m in holders) for holders in self._holders]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
