"""``osfarm.osworld.DesktopEnv``: OSWorld's ``desktop_env.desktop_env.DesktopEnv``, on a farm's desktops.

Code written for OSWorld (its ``run.py`` and ``lib_run_single.run_single_example``, the agents of
``mm_agents/``, other projects' evaluation loops) switches to osfarm by one import::

    from osfarm.osworld import DesktopEnv      # was: from desktop_env.desktop_env import DesktopEnv

The constructor takes OSWorld's arguments, plus the farm's ``farm_url``/``farm_token`` (default
``OSFARM_URL``/``OSFARM_TOKEN``). ``reset(task_config=...)`` leases a fresh desktop and runs the
task's setup; ``step(action, pause)`` returns OSWorld's ``(obs, reward, done, info)``; ``evaluate()``
the task's score; ``close()`` releases the desktop. Under it is :class:`osfarm.env.TaskEnv`, on
the private event loop thread of :class:`osfarm.env.SyncTaskEnv` (OSWorld's API is blocking; our
client is async). What maps and what does not: docs/osworld-compat.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Self

from osfarm.env import SyncTaskEnv
from osfarm.osworld.controller import OSWorldController
from osfarm.osworld.guest_forwarder import GuestForwarder
from osfarm.schema.actions import special_action
from osfarm.schema.guest import ActionTiming
from osfarm.schema.observation import AgentObservation
from osfarm.tasks.controller import GuestController
from osfarm.tasks.filecache import FileCache
from osfarm.tasks.model import Task, parse_task

log = logging.getLogger("osfarm.osworld")

# Action spaces whose actions a farm desktop runs as OSWorld does: pyautogui code strings (also
# what claude_computer_use's agents send OSWorld) and computer_13's dicts.
CODE_SPACES = ("pyautogui", "claude_computer_use")
ACTION_SPACES = (*CODE_SPACES, "computer_13")
# provider_name: OSWorld's VM providers. The farm decides which box a desktop is (sandbox,
# docker or libvirt: its settings), so every name is accepted and none chooses; the leased
# desktop's real provider is env.provider after reset.
PROVIDERS = ("vmware", "virtualbox", "docker", "aws", "azure", "gcp", "aliyun", "volcengine",
             "sandbox", "libvirt")
SPECIALS = ("WAIT", "DONE", "FAIL")
# A task_config of None on the first reset: a desktop with nothing set up.
_NO_TASK: dict[str, Any] = {"id": "osworld-no-task", "snapshot": "os", "instruction": "", "config": [],
                            "evaluator": {"func": "infeasible"}}
# OSWorld's env never truncates an episode (the runner's loop counts steps): no limit here either.
_NO_STEP_LIMIT = 1_000_000


def _choice(field: str, value: Any, allowed: tuple[str, ...], why: str = "") -> str:
    if value not in allowed:
        raise ValueError(f"{field}: expected one of {', '.join(map(repr, allowed))}, got {value!r}{why}")
    return str(value)


class DesktopEnv:
    """OSWorld's DesktopEnv over a farm (see the module docstring).

    OSWorld's arguments: ``provider_name`` (accepted, the farm decides), ``region``,
    ``path_to_vm``, ``snapshot_name``, ``headless``, ``client_password`` (accepted, unused: the
    farm holds the images and resets desktops to their baseline), ``action_space``, ``cache_dir``
    (where task files are found: a ``url_map.json`` there maps URLs to files), ``screen_size``
    (compared with the leased desktop's, a warning when they differ: the farm sets it),
    ``require_a11y_tree``, ``require_terminal``, ``os_type`` (Ubuntu only), ``enable_proxy``
    (accepted; a farm has no proxy). osfarm's: ``farm_url``, ``farm_token``, ``offline`` (never download a file the
    cache lacks), ``action_timing`` (TaskEnv's; ``"osworld"`` here, OSWorld's exact pacing, where TaskEnv's default is
    ``"settle"``), ``lease_wait_s``, ``code_timeout_s``.
    """

    def __init__(self, provider_name: str = "vmware", region: str | None = None, path_to_vm: str | None = None,
                 snapshot_name: str = "init_state", action_space: str = "pyautogui", cache_dir: str = "cache",
                 screen_size: tuple[int, int] = (1920, 1080), headless: bool = False, require_a11y_tree: bool = True,
                 require_terminal: bool = False, os_type: str = "Ubuntu", enable_proxy: bool = False,
                 client_password: str = "", *, farm_url: str | None = None, farm_token: str | None = None,
                 offline: bool = False, action_timing: ActionTiming = "osworld", lease_wait_s: float = 120.0,
                 code_timeout_s: float = 30.0):
        self.provider_name = _choice("provider_name", provider_name, PROVIDERS)
        self.action_space = _choice("action_space", action_space, ACTION_SPACES)
        if str(os_type).lower() not in ("ubuntu", "linux"):
            raise ValueError(f"os_type: osfarm's desktops are Ubuntu-like Linux; got {os_type!r} "
                             "(Windows and macOS tasks cannot run here)")
        if (not isinstance(screen_size, (tuple, list)) or len(screen_size) != 2
                or not all(isinstance(v, int) and v > 0 for v in screen_size)):
            raise ValueError(f"screen_size: expected (width, height) in pixels, got {screen_size!r}")
        self.region, self.path_to_vm, self.snapshot_name = region, path_to_vm, snapshot_name
        self.headless, self.client_password, self.os_type = headless, client_password, os_type
        self.enable_proxy = bool(enable_proxy)  # OSWorld's run scripts pass True; a farm has no proxy (reset warns)
        self.screen_size: tuple[int, int] = (int(screen_size[0]), int(screen_size[1]))
        self.require_a11y_tree, self.require_terminal = bool(require_a11y_tree), bool(require_terminal)
        self.cache_dir = cache_dir
        root = Path(cache_dir)
        url_map = root / "url_map.json"
        cache = (FileCache.with_map_file(root, url_map, offline=offline) if url_map.is_file()
                 else FileCache(root, offline=offline))
        self._sync = SyncTaskEnv(farm_url, farm_token, max_steps=_NO_STEP_LIMIT, cache=cache, offline=offline,
                                 a11y=self.require_a11y_tree, record=False, lease_wait_s=lease_wait_s,
                                 code_timeout_s=code_timeout_s, action_timing=action_timing)
        self._forwarder = GuestForwarder()
        try:
            self.server_port: int = self._sync.run(self._forwarder.start())
        except BaseException:
            self._sync.close()
            raise
        self.vm_ip = self._forwarder.host  # OSWorld's agents call http://{vm_ip}:{server_port}/...
        # ports of the VM's other services OSWorld exposes (Chrome's CDP, VNC, VLC's web UI): not
        # reachable from outside a farm desktop
        self.chromium_port: int | None = None
        self.vnc_port: int | None = None
        self.vlc_port: int | None = None
        self.controller = OSWorldController()
        self.provider: str | None = None  # the leased desktop's box: sandbox, docker or libvirt
        self.task_id: str | None = None
        self.instruction: str = ""
        self.evaluator: dict[str, Any] = {}
        self.action_history: list[Any] = []
        self._task: Task | None = None
        self._closed = False

    # -- OSWorld's surface ------------------------------------------------------------------------

    def reset(self, task_config: dict[str, Any] | None = None, seed: int | None = None,
              options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Lease a fresh desktop and run ``task_config``'s setup; the first observation.

        ``task_config=None`` runs the previous task again (an empty desktop on the first reset).
        ``seed`` and ``options`` are accepted as OSWorld's are (it uses neither).
        """
        self._check_open()
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"seed: expected an int or None, got {seed!r}")
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"options: expected a dict or None, got {type(options).__name__}")
        if task_config is not None:
            self._task = parse_task(task_config, file="task_config")
        elif self._task is None:
            self._task = parse_task(_NO_TASK, file="task_config")
        task = self._task
        if self.enable_proxy and task.proxy:
            log.warning("task %s: proxy: a farm desktop has no proxy; the task runs without one (as OSWorld "
                        "runs it with enable_proxy=False)", task.id)
        self._forwarder.desktop = None
        self.controller.attach(None)
        obs, _info = self._sync.reset(task)
        lease = self._sync.desktop
        assert lease is not None
        self.provider = lease.provider
        self.controller.attach(GuestController(base_url=f"{self._sync.farm.url}/v1/desktops/{lease.id}/guest",
                                               token=self._sync.farm.token))
        self._sync.run(self._forward_to(lease.id))
        size = (lease.screen.width, lease.screen.height)
        if size != self.screen_size:
            log.warning("screen_size: asked for %dx%d, the farm's desktop is %dx%d (env.screen_size now says so)",
                        *self.screen_size, *size)
            self.screen_size = size
        self.task_id, self.instruction = task.id, task.instruction
        self.evaluator = task.evaluator.to_json()
        self.action_history = []
        return self._observation(obs)

    def step(self, action: str | dict[str, Any], pause: float = 2) -> tuple[dict[str, Any], float, bool, dict]:
        """Run one action; ``(observation, reward, done, info)`` as OSWorld's.

        ``WAIT`` waits ``pause`` seconds; ``DONE`` and ``FAIL`` end the episode (``done``, and
        ``info`` ``{"done": True}`` / ``{"fail": True}``). Other actions run on the desktop, and the
        observation waits up to ``pause`` s for the screen to settle (OSWorld sleeps ``pause``
        always). The reward is 0, as OSWorld's: the score is :meth:`evaluate`'s.
        """
        self._check_open()
        if self._task is None:
            raise RuntimeError("call reset(task_config=...) before step()")
        if not isinstance(pause, (int, float)) or pause < 0:
            raise ValueError(f"pause: expected seconds >= 0, got {pause!r}")
        self._check_action(action)
        special = special_action(action)
        self.action_history.append(action)
        if special == "WAIT":
            time.sleep(pause)
        self._sync.env.settle_s = float(pause)
        obs, _reward, _terminated, _truncated, outcome = self._sync.step(action)
        info: dict[str, Any] = {}
        if special == "DONE":
            info["done"] = True
        elif special == "FAIL":
            info["fail"] = True
        if outcome.get("action_error"):
            info["action_error"] = outcome["action_error"]  # the agent's, as osfarm tells it
        return self._observation(obs), 0.0, special in ("DONE", "FAIL"), info

    def evaluate(self) -> float:
        """The task's score in [0, 1] (postconfig, getters, metric; ``infeasible`` tasks score 1
        when the last action was FAIL, others 0 then)."""
        self._check_open()
        if self._task is None:
            raise RuntimeError("call reset(task_config=...) before evaluate()")
        return self._sync.evaluate()

    def close(self) -> None:
        """Release the desktop and stop the env's loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.controller.attach(None)
        try:
            self._sync.run(self._forwarder.stop())
        finally:
            self._sync.close()

    def render(self, mode: str = "rgb_array") -> bytes | None:
        """The screen as PNG bytes (OSWorld's ``render``)."""
        if mode != "rgb_array":
            raise ValueError(f"mode: expected 'rgb_array', got {mode!r}")
        return self.controller.get_screenshot()

    def _get_obs(self) -> dict[str, Any]:
        """A fresh observation (OSWorld's runner calls it after its wait that follows reset)."""
        return {"screenshot": self.controller.get_screenshot(),
                "accessibility_tree": self.controller.get_accessibility_tree() if self.require_a11y_tree else None,
                "terminal": self.controller.get_terminal_output() if self.require_terminal else None,
                "instruction": self.instruction}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- ours -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DesktopEnv is closed")

    def _check_action(self, action: Any) -> None:
        if isinstance(action, str) and action in SPECIALS:
            return
        if self.action_space in CODE_SPACES and not isinstance(action, str):
            raise ValueError(f"action: action_space {self.action_space!r} takes pyautogui code strings "
                             f"or {'/'.join(SPECIALS)}, got {type(action).__name__}")
        if self.action_space == "computer_13" and not isinstance(action, dict):
            raise ValueError("action: action_space 'computer_13' takes {action_type, parameters} dicts "
                             f"or {'/'.join(SPECIALS)}, got {type(action).__name__}")

    async def _forward_to(self, lease_id: str) -> None:
        self._forwarder.desktop = await self._sync.farm.desktop(lease_id)

    def _observation(self, obs: AgentObservation) -> dict[str, Any]:
        out = obs.as_dict()
        if self.require_terminal:
            out["terminal"] = self.controller.get_terminal_output()
        return out
