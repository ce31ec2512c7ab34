"""The choice agent: one sampled token picks one of a task's few candidate actions.

A randomly initialised model cannot write pyautogui code, so a learning test on it needs an
action space it can explore: the policy server samples exactly one token (with its log-prob and
policy version, like any VLM call) and the token id modulo the number of choices selects the
action. The desktop really runs it and the task's real evaluator scores it; what the model must
learn is to put its probability mass on the tokens that map to the right action. The candidate
actions come from the task's ``osfarm_choices`` list (or the agent's ``choices``); a task's
``osfarm_choice_steps`` (default 1) is how many choices an episode makes before DONE.

With ``history_turns`` > 0 the prompt is a conversation, as the VLM agent's is (the same
:func:`~osfarm.agents.prompts.messages.build_messages`): the earlier observations with the
replies the policy gave, screenshots on the last ``history_images``. Kept whole (both at least
the episode's steps) each step's prompt is the one before it plus that step's reply and the new
observation, which is what the trainer's ``granularity: episode`` needs to train an episode as
one sequence. The default, 0, asks every step with the menu and the current screenshot alone.

The model call is async (``apredict``, our chat client): an episode waiting for the policy holds
no thread.

Like the VLM agent it leaves ``last_model_call`` (request messages, response text, token ids,
log-probs, policy version) after each ``predict`` for the episode record.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from osfarm.agents.base import ActionSpace, BaseAgent
from osfarm.agents.chat_client import ChatClient, ChatResult, PolicyBadResponse
from osfarm.agents.prompts.messages import Turn, build_messages
from osfarm.schema.actions import AgentAction
from osfarm.schema.episode import ModelCall

SYSTEM_PROMPT = "You control a Linux desktop. Answer with the number of the action to take."


class ChoiceAgent(BaseAgent):
    name = "choice"
    action_space: ActionSpace = "pyautogui"

    def __init__(self, base_url: str | None = None, model: str = "policy", *, choices: list[str] | None = None,
                 temperature: float = 1.0, timeout_s: float = 120.0, screenshot: bool = True,
                 seed: int | None = None, api_key: str | None = None, history_turns: int = 0,
                 history_images: int = 1, **_: Any):
        if not base_url:
            raise ValueError("choice agent: option 'base_url' is required (--model-url: its policy server)")
        for name, value, least in (("history_turns", history_turns, 0), ("history_images", history_images, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"choice agent: option {name!r}: expected an integer >= {least}, got {value!r}")
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
        self.history_turns = history_turns
        self.history_images = history_images
        self.turns: list[Turn] = []  # this episode's finished turns (observation, reply)
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
        self.turns = []
        self.last_model_call = None

    def _observation(self, instruction: str, obs: dict[str, Any]) -> Turn:
        menu = "\n".join(f"{i}: {c}" for i, c in enumerate(self.choices))
        png = obs.get("screenshot")
        return Turn(screenshot=png if self.screenshot and png else None, text=f"{instruction}\nActions:\n{menu}\n")

    def _request(self, current: Turn) -> list[dict[str, Any]]:
        return build_messages([{"role": "system", "content": SYSTEM_PROMPT}], self.turns, current,
                              self.history_turns, self.history_images)

    def messages(self, instruction: str, obs: dict[str, Any]) -> list[dict[str, Any]]:
        """The request of this step: the system prompt, the kept history, the observation."""
        return self._request(self._observation(instruction, obs))

    def _act(self, messages: list[dict[str, Any]], res: ChatResult, current: Turn) -> tuple[str, list[AgentAction]]:
        if not res.token_ids or res.logprobs is None:
            raise PolicyBadResponse("policy server sent no token ids / log-probs for the choice token")
        self.last_model_call = ModelCall(request=messages, response_text=res.text, response_token_ids=res.token_ids,
                                         response_logprobs=res.logprobs, policy_version=res.policy_version,
                                         t_ms=res.t_ms)
        self.taken += 1
        current.response = res.text  # verbatim: the next prompt holds the reply the policy sampled
        self.turns.append(current)
        del self.turns[:-max(1, self.history_turns)]  # only the window is ever sent again
        action = self.choices[res.token_ids[0] % len(self.choices)]
        return res.text, [action, "DONE"] if self.taken >= self.steps else [action]

    async def apredict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        """One sampled token (through :class:`ChatClient`: transient failures retried, a server that
        stays unreachable is an infra error, not the agent's)."""
        current = self._observation(instruction, obs)
        messages = self._request(current)
        seed = None if self.seed is None else self.seed + self.taken
        res = await self.client.complete(messages, temperature=self.temperature, max_tokens=1, logprobs=True, seed=seed)
        return self._act(messages, res, current)

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[AgentAction]]:
        return asyncio.run(self.apredict(instruction, obs))

    async def aclose(self) -> None:
        await self.client.aclose()
