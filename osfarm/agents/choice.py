"""The choice agent: one sampled token picks one of a task's few candidate actions.

A randomly initialised model cannot write pyautogui code, so a learning test on it needs an
action space it can explore: the policy server samples exactly one token (with its log-prob and
policy version, like any VLM call) and the token id modulo the number of choices selects the
action. The desktop really runs it and the task's real evaluator scores it; what the model must
learn is to put its probability mass on the tokens that map to the right action. The candidate
actions come from the task's ``osfarm_choices`` list (or the agent's ``choices``); a task's
``osfarm_choice_steps`` (default 1) is how many choices an episode makes before DONE.

The model call is async (``apredict``, our chat client): an episode waiting for the policy holds
no thread.

Like the VLM agent it leaves ``last_model_call`` (request messages, response text, token ids,
log-probs, policy version) after each ``predict`` for the episode record.
"""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

from osfarm.agents.base import ActionSpace, BaseAgent
from osfarm.agents.chat_client import ChatClient, ChatResult, PolicyBadResponse
from osfarm.schema.actions import AgentAction
from osfarm.schema.episode import ModelCall

SYSTEM_PROMPT = "You control a Linux desktop. Answer with the number of the action to take."


class ChoiceAgent(BaseAgent):
    name = "choice"
    action_space: ActionSpace = "pyautogui"

    def __init__(self, base_url: str | None = None, model: str = "policy", *, choices: list[str] | None = None,
                 temperature: float = 1.0, timeout_s: float = 120.0, screenshot: bool = True,
                 seed: int | None = None, api_key: str | None = None, **_: Any):
        if not base_url:
            raise ValueError("choice agent: option 'base_url' is required (--model-url: its policy server)")
        # the policy server's bearer token: from the options, else OSFARM_POLICY_TOKEN (as the VLM agent)
        self.client = ChatClient(base_url, model, timeout_s=timeout_s,
                                 api_key=api_key or os.environ.get("OSFARM_POLICY_TOKEN") or None)
        self.model = model
        self.default_choices = list(choices or [])
        self.choices = list(self.default_choices)
        self.steps = 1
        self.taken = 0
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.screenshot = screenshot
        self.seed = seed  # reproducible sampling: step i of an episode asks with seed + i
        self.last_model_call: ModelCall | None = None

    def reset(self, task: Any = None) -> None:
        extra = (getattr(task, "model_extra", None) or {}) if task is not None else {}
        self.choices = list(extra.get("osfarm_choices") or self.default_choices)
        if not self.choices:
            raise ValueError("the choice agent needs candidate actions: the task's osfarm_choices or agent.choices")
        steps = extra.get("osfarm_choice_steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"osfarm_choice_steps: expected an integer >= 1, got {steps!r}")
        self.steps = steps
        self.taken = 0
        self.last_model_call = None

    def messages(self, instruction: str, obs: dict[str, Any]) -> list[dict[str, Any]]:
        menu = "\n".join(f"{i}: {c}" for i, c in enumerate(self.choices))
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"{instruction}\nActions:\n{menu}\n"}]
        png = obs.get("screenshot")
        if self.screenshot and png:
            parts.append({"type": "image_url",
                          "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}})
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": parts}]

    def _act(self, messages: list[dict[str, Any]], res: ChatResult) -> tuple[str, list[AgentAction]]:
        if not res.token_ids or res.logprobs is None:
            raise PolicyBadResponse("policy server sent no token ids / log-probs for the choice token")
        self.last_model_call = ModelCall(request=messages, response_text=res.text, response_token_ids=res.token_ids,
                                         response_logprobs=res.logprobs, policy_version=res.policy_version,
                                         t_ms=res.t_ms)
        self.taken += 1
        action = self.choices[res.token_ids[0] % len(self.choices)]
        return res.text, [action, "DONE"] if self.taken >= self.steps else [action]

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        """One sampled token (through :class:`ChatClient`: transient failures retried, a server that
        stays unreachable is an infra error, not the agent's)."""
        messages = self.messages(instruction, obs)
        seed = None if self.seed is None else self.seed + self.taken
        res = await self.client.complete(messages, temperature=self.temperature, max_tokens=1, logprobs=True, seed=seed)
        return self._act(messages, res)

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        return asyncio.run(self.apredict(instruction, obs))

    async def aclose(self) -> None:
        await self.client.aclose()
