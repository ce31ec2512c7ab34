"""The choice agent: one sampled token picks one of a task's few candidate actions.

A randomly initialised model cannot write pyautogui code, so a learning test on it needs an
action space it can explore: the policy server samples exactly one token (with its log-prob and
policy version, like any VLM call) and the token id modulo the number of choices selects the
action. The desktop really runs it and the task's real evaluator scores it; what the model must
learn is to put its probability mass on the tokens that map to the right action. The candidate
actions come from the task's ``osfarm_choices`` list (or the agent's ``choices``).

Like the VLM agent it leaves ``last_model_call`` (request messages, response text, token ids,
log-probs, policy version) after each ``predict`` for the episode record.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx

from osfarm.agents.base import Action

SYSTEM_PROMPT = "You control a Linux desktop. Answer with the number of the action to take."


class ChoiceAgent:
    name = "choice"
    action_space = "pyautogui"

    def __init__(self, base_url: str, model: str = "policy", *, choices: list[str] | None = None,
                 temperature: float = 1.0, timeout_s: float = 120.0, screenshot: bool = True, **_: Any):
        self.url = base_url.rstrip("/").removesuffix("/v1") + "/v1/chat/completions"
        self.model = model
        self.default_choices = list(choices or [])
        self.choices = list(self.default_choices)
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.screenshot = screenshot
        self.last_model_call: dict[str, Any] | None = None

    def reset(self, task: Any = None) -> None:
        extra = (getattr(task, "model_extra", None) or {}) if task is not None else {}
        self.choices = list(extra.get("osfarm_choices") or self.default_choices)
        if not self.choices:
            raise ValueError("the choice agent needs candidate actions: the task's osfarm_choices or agent.choices")
        self.last_model_call = None

    def messages(self, instruction: str, obs: dict[str, Any]) -> list[dict[str, Any]]:
        menu = "\n".join(f"{i}: {c}" for i, c in enumerate(self.choices))
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"{instruction}\nActions:\n{menu}\n"}]
        png = obs.get("screenshot")
        if self.screenshot and png:
            parts.append({"type": "image_url",
                          "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}})
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": parts}]

    def predict(self, instruction: str, obs: dict[str, Any]) -> tuple[str, list[Action]]:
        messages = self.messages(instruction, obs)
        body = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": self.temperature,
                "n": 1, "logprobs": True, "return_tokens_as_token_ids": True}
        t0 = time.perf_counter()
        r = httpx.post(self.url, json=body, timeout=self.timeout_s)
        r.raise_for_status()
        data = r.json()
        choice = data["choices"][0]
        ids = choice.get("token_ids") or [int(t["token"].split(":", 1)[1]) for t in choice["logprobs"]["content"]]
        logprobs = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
        version = data.get("policy_version")
        if version is None and r.headers.get("x-policy-version") is not None:
            version = int(r.headers["x-policy-version"])
        text = choice["message"].get("content") or ""
        self.last_model_call = {"request": messages, "response_text": text, "response_token_ids": ids,
                                "response_logprobs": logprobs, "policy_version": version,
                                "t_ms": round((time.perf_counter() - t0) * 1000, 1), "error": None}
        action = self.choices[ids[0] % len(self.choices)]
        return text, [action, "DONE"]
