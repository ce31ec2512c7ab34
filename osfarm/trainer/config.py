"""``train.yaml``: the settings of an ``osfarm train`` run (a pydantic model).

With no file the embedded default runs on one machine: the tiny model, the in-process sandbox
farm, the in-process scheduler, one CPU policy server subprocess and the tiny choice suite
(tests/fixtures/train_suite). Every key has a default; a bad value is reported as
``FILE:LINE: key.path: message``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from osfarm.config import read_yaml_mapping, validation_message
from osfarm.errors import OsfarmError
from osfarm.policy.client import PolicyServer
from osfarm.schema.budget import Budget
from osfarm.schema.guest import DEFAULT_ACTION_TIMING, ActionTiming
from osfarm.trainer.curriculum import Curriculum
from osfarm.trainer.learner import LearnerOptions
from osfarm.trainer.metrics import WandbOptions

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SUITE = REPO_ROOT / "tests" / "fixtures" / "train_suite"
log = logging.getLogger("osfarm.trainer")


class TrainConfigError(OsfarmError, ValueError):
    """A train.yaml problem; the message names the file and line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FarmSection(_Strict):
    url: str | None = Field(default=None, description="farm API URL; none: start an in-process farm")
    token: str | None = Field(default=None, description="farm token (or OSFARM_TOKEN)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="FarmSettings for the in-process farm")
    spares: int = Field(default=1, ge=0, description="in-process farm: desktops kept ready beyond rollout.envs, so "
                        "an episode leases one while a released desktop resets (asynchronous runs reset on the "
                        "rollouts' path: about envs x reset time / episode time hides the resets)")


class PolicySection(_Strict):
    servers: list[PolicyServer] = Field(default_factory=list, description="running policy servers to use and sync")
    spawn: int = Field(default=1, ge=0,
                       description="CPU policy servers to start (osfarm policy serve) when servers is empty")
    delay_ms: float = Field(default=0.0, ge=0, description="spawned servers: artificial latency per request")
    delay_sigma: float = Field(default=0.0, ge=0,
                               description="spawned servers: lognormal sigma of that latency (0: fixed)")
    start_timeout_s: float = Field(default=120.0, gt=0)
    model_name: str = Field(default="policy", description="model name agents send")
    sync_wave: int | None = Field(default=None, ge=1, description="servers reloaded at once by the weight sync "
                                  "(default: half of them; 1: one at a time)")
    max_adapters: int | None = Field(default=None, ge=2, description="vllm_lora over the queue: adapters a server "
                                     "keeps at most (vLLM's --max-loras); a load past it evicts the oldest, and the "
                                     "jobs still keeping it are aborted and retried (default: no cap)")


# a reply cut at max_tokens is a parse error, and trains as one: each format's budget holds its
# longest ordinary reply (UI-TARS writes a thought before its action; 64 tokens cut most of them)
REPLY_TOKENS = {"pyautogui": 512, "computer_13": 512, "uitars": 1024}


class AgentSection(_Strict):
    kind: Literal["vlm", "choice"] = Field(
        default="choice", description="vlm: H4's VLM agent; choice: one token picks one of `choices`"
    )
    prompt_format: str = "pyautogui"
    observation: str = "screenshot"
    history_turns: int | None = Field(default=None, ge=0, description="earlier turns kept in the prompt (default: "
                                      "2 for vlm, 0 for choice; rollout.max_steps, the whole episode, with "
                                      "data.options granularity: episode)")
    history_images: int | None = Field(default=None, ge=1, description="screenshots in the prompt, the current one "
                                       "included (default: 1; rollout.max_steps with granularity: episode)")
    temperature: float = Field(default=0.1, ge=0, description="sampling temperature (learner.temperature must match)")
    max_tokens: int | None = Field(default=None, ge=1, description="reply token budget (default: the prompt "
                                   "format's, REPLY_TOKENS: a UI-TARS thought + action runs to hundreds)")
    timeout_s: float = Field(default=120.0, gt=0)
    choices: list[str] = Field(default_factory=list, description="choice agent: the actions (default: the suite's)")
    screenshot: bool = Field(default=True, description="choice agent: send the screenshot with the menu")
    min_pixels: int | None = Field(default=None, ge=1, description="vlm agent: screenshot resize bounds its "
                                   "coordinates are mapped with (default: budget's, which must agree)")
    max_pixels: int | None = Field(default=None, ge=1, description="see min_pixels")
    top_logprobs: int = Field(default=0, ge=0, le=20, description="vlm agent: record each token's k likeliest "
                              "log-probs, so data.options.entropy_fraction ranks steps by top-k entropy (0: by the "
                              "sampled tokens' surprisal, near 0 at a low temperature)")

    def reply_tokens(self) -> int:
        """``max_tokens``, or the prompt format's default budget."""
        return self.max_tokens or REPLY_TOKENS.get(self.prompt_format, 512)


class RolloutSection(_Strict):
    envs: int = Field(default=2, ge=1, description="most episodes at once")
    eta: int = Field(default=1, ge=0, description="max policy-version lag of a sample (0 = synchronous)")
    batch_size: int = Field(default=8, ge=1, description="episodes consumed per update (whole groups: at least this)")
    max_steps: int = Field(default=1, ge=1)
    episode_time_limit_s: float = Field(default=300.0, gt=0)
    action_timing: ActionTiming = Field(default=DEFAULT_ACTION_TIMING, description="how the rollouts' actions are "
                                        "paced: settle, osworld or fast (osfarm eval --action-timing)")
    dynamic_length: bool = Field(default=True, description="DART: a solved task's step limit follows its successes")
    length_margin: float = Field(default=1.5, ge=1.0, description="dynamic_length: limit = margin × longest success")
    interruptible: bool = Field(default=False, description="AReaL: an episode in flight moves to the newest weights "
                                "at its next step (each step records its version)")
    seed_exemplars: bool = Field(default=False, description="XRPO: a task with no success yet gets a solved related "
                                 "task's episode as an exemplar in the prompt of some of its rollouts")
    seed_fraction: float = Field(default=0.5, gt=0, le=1, description="seed_exemplars: share of the group seeded")
    curriculum: Curriculum = Field(default_factory=Curriculum, description="retire solved tasks, weight the rest "
                                   "by difficulty (off by default)")
    options: dict[str, Any] = Field(default_factory=dict, description="rollout controller options: allocator "
                                    "(dart|fixed|xrpo), group_size, redundancy, max_retries, rollout_n, xrpo_*")
    executor: Literal["inprocess", "celery"] = Field(
        default="inprocess", description="inprocess: the trainer runs episodes on farm.url (or its own farm); "
        "celery: each rollout is a job for `osfarm worker`s on any host, records come back on a Redis Stream")
    broker: str | None = Field(default=None, description="executor celery: Redis URL of the broker, result backend "
                               "and record stream (default OSFARM_BROKER)")
    stream: str = Field(default="osfarm:train", min_length=1,
                        description="executor celery: the Redis Stream the workers publish this run's records to")
    worker_out: Path | None = Field(default=None, description="executor celery: the workers' OSFARM_WORKER_OUT as "
                                    "this machine sees it (records' blobs are under <worker_out>/<run id>); none: "
                                    "workers write into the run dir, at the same path (a shared filesystem)")


class DataSection(_Strict):
    options: dict[str, Any] = Field(default_factory=dict, description="data manager options")


class MetricsSection(_Strict):
    prometheus_port: int | None = Field(default=None, ge=0, le=65535, description="serve /metrics here (0: any port)")
    plot: bool = True
    tensorboard: bool = Field(default=True, description="event files in <run>/tensorboard")
    wandb: WandbOptions = Field(default_factory=WandbOptions)


class DeviceMap(_Strict):
    """Which devices do what (ROLL's device map): torch device names, ``cpu`` or ``cuda:N``."""

    learner: list[str] = Field(default_factory=list, description="one per learner rank (default: each rank's own GPU, "
                               "else the CPU)")
    reference: str | None = Field(default=None, description="the KL reference model (default: the learner's device)")
    policy: list[str] = Field(default_factory=list, description="one per spawned policy server (CUDA_VISIBLE_DEVICES); "
                              "for vLLM replicas see `osfarm policy vllm-command --device`")

    @model_validator(mode="after")
    def _names(self) -> DeviceMap:
        for d in [*self.learner, *self.policy, *([self.reference] if self.reference else [])]:
            kind, _, index = d.partition(":")
            if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
                raise ValueError(f"device {d!r}: expected 'cpu' or 'cuda:N'")
        return self


class TrainConfig(_Strict):
    run_dir: Path | None = Field(default=None, description="default runs/train-<time>")
    model: str = Field(default="tiny", description="HF model dir, or `tiny`")
    resume: bool = Field(default=True, description="continue from the run dir's latest checkpoint")
    updates: int = Field(default=4, ge=1, description="stop once the policy reaches this version")
    max_episodes: int | None = Field(default=None, ge=1,
                                     description="also stop after this many episodes (this process)")
    suite: Path = Field(default=DEFAULT_SUITE)
    tasks: list[str] = Field(default_factory=list, description="task ids (default: all of the suite)")
    keep_checkpoints: int = Field(default=3, ge=1)
    checkpoint_every: int = Field(default=1, ge=1, description="a full checkpoint (optimizer, master weights, data "
                                  "state; written in the background) every this many versions, and at the last; "
                                  "the served weights the policy servers sync to are written every version")
    seed: int = 0
    learner_cpus: list[int] | None = Field(
        default=None, min_length=1,
        description="pin the learner to these CPUs and everything else the trainer starts (farm, desktops, "
                    "spawned policy servers) to the others: training and rollouts on disjoint cores, as the "
                    "trainer and inference devices of a GPU cluster are")
    farm: FarmSection = Field(default_factory=FarmSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    agent: AgentSection = Field(default_factory=AgentSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    data: DataSection = Field(default_factory=DataSection)
    # the tiny model's next-token distribution is almost flat over its 1k tokens: at T = 0.1 about
    # 45 tokens carry the mass, so the choice task is explorable and learnable in a few updates
    learner: LearnerOptions = Field(default_factory=lambda: LearnerOptions(lr=2e-3, temperature=0.1))
    budget: Budget = Field(default_factory=Budget, description="image resize bounds and token limits, set once: "
                           "the agent, the learner and `osfarm policy vllm-command` take them from here")
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    nproc: int = Field(default=1, ge=1, description="learner ranks (torch.distributed; `osfarm train --nproc N`)")
    devices: DeviceMap = Field(default_factory=DeviceMap)
    pool_from: list[Path] = Field(default_factory=list, description="`osfarm eval` run dirs whose successes "
                                  "seed the experience pool (DART's pre-collected successes)")
    eval_every: int | None = Field(default=None, ge=1, description="evaluate on eval_suite every this many versions")
    eval_suite: Path | None = Field(default=None, description="held-out task suite for eval_every")
    eval_tasks: list[str] = Field(default_factory=list, description="task ids of eval_suite (default: all)")
    eval_episodes: int = Field(default=1, ge=1, description="episodes per eval task and evaluation")

    @model_validator(mode="after")
    def _servers_or_spawn(self) -> TrainConfig:
        if not self.policy.servers and self.policy.spawn < 1:
            raise ValueError("policy: give servers or spawn >= 1")
        if self.agent.temperature > 0 and abs(self.agent.temperature - self.learner.temperature) > 1e-9:
            raise ValueError(f"learner.temperature ({self.learner.temperature}) must equal agent.temperature "
                             f"({self.agent.temperature}): the behaviour log-probs are of the tempered distribution")
        if self.learner.lora is None and any(s.kind == "vllm_lora" for s in self.policy.servers):
            raise ValueError("policy.servers: kind vllm_lora loads LoRA adapters; set learner.lora")
        if self.learner.lora is not None:  # a server other than vLLM's LoRA route reloads whole (merged) weights
            whole = not self.policy.servers or any(s.kind != "vllm_lora" for s in self.policy.servers)
            if self.learner.lora.save_merged is None:
                self.learner.lora.save_merged = whole
            elif whole and not self.learner.lora.save_merged:
                raise ValueError("learner.lora.save_merged: false, but a policy server (spawned, or kind osfarm or "
                                 "command) reloads the merged model; set it true or use vllm_lora servers only")
        for s in self.policy.servers:
            if s.kind == "vllm_lora" and not s.lora_versioned and s.lora_name == self.policy.model_name:
                raise ValueError(f"policy.servers: {s.url}: lora_name {s.lora_name!r} is the base model's name "
                                 "(policy.model_name); an in-place adapter needs a name of its own")
        for name, agent_name in (("min_pixels", "min_pixels"), ("max_pixels", "max_pixels"),
                                 ("max_response_tokens", "max_tokens")):  # one budget: the agent's follows it
            want, have = getattr(self.budget, name), getattr(self.agent, agent_name)
            if want is not None and have is not None and want != have:
                raise ValueError(f"agent.{agent_name} ({have}) disagrees with budget.{name} ({want}); set it once, "
                                 "in budget")
            if want is not None:
                setattr(self.agent, agent_name, want)
        self._history_window()
        if self.eval_every is not None and self.eval_suite is None:
            raise ValueError("eval_every needs eval_suite (the held-out tasks)")
        if self.devices.learner and len(self.devices.learner) not in (1, self.nproc) and self.nproc > 1:
            raise ValueError(f"devices.learner lists {len(self.devices.learner)} devices for nproc={self.nproc} "
                             "learner ranks (one each)")
        if self.devices.policy and not self.policy.servers and len(self.devices.policy) != self.policy.spawn:
            raise ValueError(f"devices.policy lists {len(self.devices.policy)} devices for policy.spawn="
                             f"{self.policy.spawn} servers (one each)")
        return self

    def _history_window(self) -> None:
        """The agent's history window where unset: its kind's default, or under ``granularity: episode``
        the whole episode: an episode trains as one sequence only when each step's prompt is the one
        before it plus that step's reply (a cut window makes every longer episode train per step)."""
        a, steps = self.agent, self.rollout.max_steps
        whole = self.data.options.get("granularity") == "episode"
        if a.history_turns is None:
            a.history_turns = steps if whole else (2 if a.kind == "vlm" else 0)
        if a.history_images is None:
            a.history_images = steps if whole else 1
        if whole and (a.history_turns < steps - 1 or (a.history_images < steps and (a.kind == "vlm" or a.screenshot))):
            log.warning("granularity: episode with agent.history_turns %d and history_images %d below "
                        "rollout.max_steps %d: episodes longer than the window train per step "
                        "(episode_fallback_history_cut)", a.history_turns, a.history_images, steps)


def load_train_config(path: Path | None, **overrides: Any) -> TrainConfig:
    """The config from ``path`` (None: the embedded default) with top-level ``overrides``."""
    data: dict[str, Any] = {}
    text = ""
    if path is not None:
        data, text = read_yaml_mapping(Path(path), TrainConfigError)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise TrainConfigError(validation_message(e, path, text, "train config")) from None
