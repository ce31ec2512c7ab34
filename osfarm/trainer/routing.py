"""Which weights answer each step of an episode, and the policy version recorded for it.

The trainer wraps every rollout's agent in :class:`RoutedAgent`. Before each model call it asks
the weight sync for the model name to request (``route()``: our server's name, or the vLLM
adapter ``policy-v<N>`` of version N) and after the call it records the version on the step when
the server's answer carried none (vLLM's does not).

* Non-interruptible (default): the episode keeps the name it started with, so every step is
  tagged with that adapter's exact version (for a server whose weights are replaced in place, a
  lower bound of it: versions only rise, so the staleness computed from it is never too small).
* Interruptible (AReaL): each step asks again, so an episode in flight moves to the newest
  adapter at its next step; every step is tagged with the version that produced it and the
  learner's per-token behaviour log-probs stay exact across the switch. (Our CPU server and vLLM
  reloaded in place always behave this way: their weights change under the episode, and our
  server's answers say which version produced each step.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from osfarm.agents import Agent
from osfarm.runner.executors.rollout_control import tag_version
from osfarm.schema.actions import AgentAction

Route = Callable[[], tuple[str, int | None]]  # -> (model name to request, the version it stands for)


class RoutedAgent:
    """An agent whose model calls go where ``route`` says; everything else is the agent's own."""

    def __init__(self, agent: Agent, route: Route, *, interruptible: bool = False,
                 serving: Callable[[], AbstractAsyncContextManager[None]] | None = None):
        self.agent = agent
        self.route = route
        self.serving = serving  # held around each model call: waits while the server swaps weights
        self.interruptible = interruptible
        self.model, self.version = route()
        self._point(self.model)
        self.step_versions: list[int | None] = []

    def _point(self, model: str) -> None:
        client = getattr(self.agent, "client", None)
        if client is not None and hasattr(client, "model"):
            client.model = model

    def __getattr__(self, name: str) -> Any:  # name, wants_a11y, settle_s, last_model_call, ...
        return getattr(self.agent, name)

    def reset(self, task: Any = None) -> None:
        self.agent.reset(task)

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        async with self.serving() if self.serving is not None else contextlib.nullcontext():
            if self.interruptible:
                model, version = self.route()
                if model != self.model:
                    self._point(model)
                self.model, self.version = model, version
            out = await self.agent.apredict(instruction, obs)
        tag_version(self.agent, self.version, self.step_versions)
        return out

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        return self.agent.predict(instruction, obs)

    async def aclose(self) -> None:
        await self.agent.aclose()
