"""Docker provider: one container of ``osfarm/desktop`` per desktop.

Each container starts as root with only the capabilities its init needs (``SETUID``, ``SETGID``,
``CHOWN``, ``FOWNER``; no others), under docker's init (``init: true``: tini reaps and forwards
signals). Its init (:mod:`osfarm.desktop.box.box_init`) fills the agent's home (a size-capped tmpfs),
makes the agent's world (:mod:`osfarm.desktop.box.agent_world`: ``user`` in a user namespace whose ids
map to :data:`AGENT_BASE`..+65535, with ``sudo`` inside it) and runs the session launcher as the
guest uid (:data:`GUEST_UID`, unmapped there), so the agent, its root included, cannot signal or
replace the guest server. ``no-new-privileges`` is off, because OSWorld's ``sudo`` is a setuid
program; what that costs is in docs/security.md. Limits: memory, CPU, ``pids_limit``, tmpfs
sizes. Labels:

* ``org.osfarm.scope``   the shared dir of the farm that owns it (one farm per shared dir, held
                         by a lock file), so two farms on one daemon never touch each other's boxes
* ``org.osfarm.farm``    the provider instance that made it (a new id per farm process)
* ``org.osfarm.desktop`` the desktop id

Networking: ``none`` (default) gives the box only its loopback; the guest listens on a unix
socket in ``<shared dir>/<desktop>/<generation>/``, bind-mounted at ``/run/osfarm``. ``host``
shares the host's network: the guest listens on a loopback port picked per desktop, and each
box gets its own X display number (X's abstract sockets live in the network namespace).

Reset replaces the container: the new one is created and started while the old one is killed
and removed, so a reset costs one container start plus the session's own start-up. With
``reset_mode: warm`` the container is kept and its guest puts it back to the state of its cold
start (:mod:`osfarm.providers.warm_reset`, as for sandbox desktops), falling back to a replaced
container where the fingerprint differs, on an error, past ``warm_reset_timeout_s`` or every
``cold_every`` resets. CPU-seconds of a desktop: its container's cgroup (what dockerd and runc
spend to make it is not counted).

Containers whose scope is ours but whose farm id is not were left by a farm that died; the next
farm of the scope takes over those its registry names (``adopt``: still running, same scope and
desktop, their run dir with the socket and token still there) and ``reap_orphans`` removes the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import psutil

from osfarm.config import FarmSettings
from osfarm.desktop.box.agent_world import AgentWorldSpec
from osfarm.desktop.box.box_init import PLAN_ENV, BoxPlan
from osfarm.desktop.session import gnome
from osfarm.desktop.session.session import home_files
from osfarm.images.daemon import DockerUnavailable, docker_client
from osfarm.images.recipes import (
    DESKTOP_AGENT_BASE,
    DESKTOP_GUEST_UID,
    DESKTOP_HOME_TEMPLATE,
)
from osfarm.providers import docker_seccomp
from osfarm.providers.base import (
    DesktopHandle,
    DesktopSpec,
    GuestEndpoint,
    ProviderError,
    tree_cpu_seconds,
)
from osfarm.providers.boxes import (
    SOCKET_PATH_MAX,
    SocketClaim,
    abstract_x_displays,
    check_desktop_id,
    discarded_on_failure,
    free_loopback_port,
    remove_stale_dirs,
    take_farm_lock,
    wait_guest_ready,
)
from osfarm.providers.cgroups import DesktopCgroup, Limits, parse_size
from osfarm.providers.warm_reset import WarmResets

log = logging.getLogger("osfarm.providers.docker")

LABEL_SCOPE = "org.osfarm.scope"
LABEL_FARM = "org.osfarm.farm"
LABEL_DESKTOP = "org.osfarm.desktop"
GUEST_UID = DESKTOP_GUEST_UID  # the image's osfarm-guest
AGENT_BASE = DESKTOP_AGENT_BASE  # the agent's root; "user" is AGENT_BASE + 1000
CAPS = ["SETUID", "SETGID", "SETFCAP", "CHOWN", "FOWNER"]  # what the box's init needs, nothing more
HOME_TEMPLATE = DESKTOP_HOME_TEMPLATE  # the image's home, copied into the tmpfs home
BOX_PYTHON = "/opt/osfarm/bin/python"
STATE_POLL_S = 0.5
SHM_SIZE = "512m"  # Chromium needs more than docker's 64 MB /dev/shm
BOX_RUN_DIR = "/run/osfarm"
BOX_PATH = "/opt/osfarm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class DockerProvider:
    """Provider protocol implementation with Docker containers (see module doc)."""

    name = "docker"

    def __init__(self, settings: FarmSettings):
        self.settings = settings
        try:
            self.client = docker_client(timeout=60)
        except DockerUnavailable as e:
            raise ProviderError(str(e)) from None
        self.image = settings.docker_image
        self.image_id, self.image_labels = self._check_image(self.image)
        self.network = settings.docker_network
        self.state_dir = Path(settings.state_dir).expanduser().absolute()
        self.shared_dir = Path(settings.docker_shared_dir or self.state_dir / "docker").expanduser().absolute()
        longest = self.shared_dir / ("x" * 12) / ("x" * 8) / "guest.sock"
        if len(os.fsencode(longest)) > SOCKET_PATH_MAX:
            raise ProviderError(
                f"docker_shared_dir {self.shared_dir} is too long for unix socket paths "
                f"({len(os.fsencode(longest))} > {SOCKET_PATH_MAX} bytes): set a shorter OSFARM_DOCKER_SHARED_DIR"
            )
        try:
            self.shared_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ProviderError(f"docker_shared_dir {self.shared_dir}: cannot create it ({e.strerror})") from None
        self.scope = str(self.shared_dir)
        try:
            self.home_size = parse_size(settings.sandbox_home_size)
            self.tmp_size = parse_size(settings.sandbox_tmp_size)
        except ValueError as e:
            raise ProviderError(f"desktop disk settings: {e}") from None
        try:
            self.limits = Limits(parse_size(settings.docker_memory), settings.docker_pids, 100)
        except ValueError as e:
            raise ProviderError(f"docker_memory: {e}") from None
        self._cgroups: dict[str, DesktopCgroup] = {}  # container id -> its cgroups, found on first check
        self.security_opt = [f"seccomp={docker_seccomp.profile_json()}"]
        if any("apparmor" in str(o) for o in self._daemon_security()):
            # docker-default's AppArmor profile refuses every mount, the agent's world's included.
            self.security_opt.append("apparmor=unconfined")
        self.farm_id = secrets.token_hex(6)
        self._lock_fd = self._take_lock()
        self._containers: dict[str, str] = {}  # desktop id -> container id of its current box
        self._host_displays: dict[str, int] = {}  # "<desktop>/<generation>" -> X display (host network)
        self.warm = WarmResets(settings)
        self._closed = False

    # -- setup ------------------------------------------------------------------------------

    def _check_image(self, ref: str) -> tuple[str, dict[str, str]]:
        from docker.errors import DockerException, ImageNotFound

        try:
            img = self.client.images.get(ref)
        except ImageNotFound:
            raise ProviderError(
                f"docker image {ref} is missing: build it with `osfarm image build` "
                "(or set OSFARM_DOCKER_IMAGE to an image that exists)"
            ) from None
        except DockerException as e:
            raise ProviderError(f"docker image {ref}: {e}") from None
        return img.id, dict(img.labels or {})

    def _daemon_security(self) -> list[str]:
        try:
            return list(self.client.info().get("SecurityOptions") or [])
        except Exception:  # noqa: BLE001 - only a hint; the container start names real problems
            return []

    def _take_lock(self) -> int:
        return take_farm_lock(self.shared_dir / ".farm.lock", f"docker_shared_dir {self.shared_dir}",
                              "stop it or set a different OSFARM_DOCKER_SHARED_DIR / OSFARM_STATE_DIR",
                              owner=self.farm_id)

    # -- helpers ----------------------------------------------------------------------------

    def _make_run_dir(self, desktop_id: str, gen: str, token: str) -> Path:
        run = self.shared_dir / desktop_id / gen
        run.mkdir(parents=True)
        tok = run / "token"
        fd = os.open(tok, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        # The guest's alone; a farm that is not root leaves it searchable, and the box's init
        # makes it the guest's (CHOWN, FOWNER).
        if os.geteuid() == 0:
            os.chown(tok, GUEST_UID, GUEST_UID)
            os.chown(run, GUEST_UID, GUEST_UID)
            os.chmod(run, 0o700)
        else:
            os.chmod(run, 0o711)
        return run

    def _labels(self, desktop_id: str) -> dict[str, str]:
        return {LABEL_SCOPE: self.scope, LABEL_FARM: self.farm_id, LABEL_DESKTOP: desktop_id}

    def _launcher_args(self, spec: DesktopSpec, port: int | None, display: int) -> list[str]:
        cmd = ["--width", str(spec.width), "--height", str(spec.height),
               "--depth", str(spec.depth), "--display", f":{display}", "--home", "/home/user",
               "--desktop", spec.desktop,
               "--token-file", f"{BOX_RUN_DIR}/token", "--state-file", f"{BOX_RUN_DIR}/state.json"]
        if port is None:
            cmd += ["--socket", f"{BOX_RUN_DIR}/guest.sock"]
        else:
            cmd += ["--port", str(port), "--host", "127.0.0.1"]
        return cmd

    def _plan(self, desktop_id: str, spec: DesktopSpec, port: int | None, display: int) -> BoxPlan:
        """What the container's init does (see the module doc)."""
        hostname = f"osfarm-{desktop_id}" if self.network == "none" else ""
        env = {"PATH": BOX_PATH, "HOME": "/home/user", "USER": "osfarm-guest", "LANG": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", "OSFARM_PYTHON": BOX_PYTHON,
               "XDG_CACHE_HOME": f"{BOX_RUN_DIR}/cache", "XDG_CONFIG_HOME": f"{BOX_RUN_DIR}/config", **spec.extra_env}
        # The password hash: the image's own (its user was made with OSWorld's password).
        agent = AgentWorldSpec(guest_uid=GUEST_UID, guest_gid=GUEST_UID, outside_base=AGENT_BASE,
                               password_hash="", hostname=hostname)
        return BoxPlan(
            launcher=[BOX_PYTHON, "-m", "osfarm.desktop.launch.launcher", *self._launcher_args(spec, port, display)],
            env=env, guest_uid=GUEST_UID, guest_gid=GUEST_UID, run_dir=BOX_RUN_DIR,
            home="/home/user", home_uid=AGENT_BASE + 1000, home_gid=AGENT_BASE + 1000,
            home_template=HOME_TEMPLATE, home_files=home_files(spec.desktop),
        etc_files=gnome.timezone_files(spec.timezone) if spec.desktop == "gnome" else {}, agent=agent, cwd="/home/user",
        )  # fmt: skip

    def _host_display(self) -> int:
        """With host networking X's abstract sockets are shared with the host: pick a free number."""
        taken = set(abstract_x_displays())
        taken.update(self._host_displays.values())
        return next(n for n in range(200, 10000) if n not in taken)

    def _run_container(self, desktop_id: str, gen: str, spec: DesktopSpec, run: Path, port: int | None,
                       display: int) -> Any:
        env = {PLAN_ENV: self._plan(desktop_id, spec, port, display).to_json()}
        kwargs: dict[str, Any] = dict(
            command=[BOX_PYTHON, "-m", "osfarm.desktop.box.box_init", "--env", PLAN_ENV],
            name=f"osfarm-{desktop_id}-{gen}",
            labels=self._labels(desktop_id),
            init=True,
            detach=True,
            mem_limit=self.settings.docker_memory,
            nano_cpus=int(self.settings.docker_cpus * 1e9),
            shm_size=SHM_SIZE,
            network_mode=self.network,
            volumes={str(run): {"bind": BOX_RUN_DIR, "mode": "rw"}},
            environment=env,
            user="0:0",
            cap_drop=["ALL"],
            cap_add=CAPS,
            security_opt=self.security_opt,
            pids_limit=self.settings.docker_pids,
            tmpfs={
                "/home/user": f"size={self.home_size},mode=0755",
                "/tmp": f"size={self.tmp_size},mode=1777",
                "/var/tmp": f"size={self.tmp_size},mode=1777",
            },
        )
        if self.network == "none":
            kwargs["hostname"] = f"osfarm-{desktop_id}"  # host networking shares the host's UTS name
        return self.client.containers.run(self.image, **kwargs)

    def _logs(self, container_id: str, lines: int = 30) -> str:
        from docker.errors import DockerException

        try:
            text = self.client.api.logs(container_id, tail=lines).decode(errors="replace").strip()
        except DockerException as e:
            return f"(no logs: {e})"
        return text or "(empty log)"

    def _remove(self, container_id: str) -> None:
        """Kill and remove a container (blocking; run in a thread)."""
        from docker.errors import APIError, NotFound

        try:
            self.client.api.remove_container(container_id, force=True, v=True)
        except NotFound:
            pass
        except APIError as e:
            if "already in progress" not in str(e):  # removed by someone else right now
                raise

    # -- protocol ---------------------------------------------------------------------------

    async def reap_orphans(self) -> int:
        """Remove containers of our scope made by another (dead) farm, and stale run dirs."""
        flt = {"label": [f"{LABEL_SCOPE}={self.scope}"]}
        found = await asyncio.to_thread(self.client.api.containers, all=True, filters=flt)
        adopted = set(self._containers.values())  # taken over from the previous farm (adopt)
        victims = [c for c in found if c.get("Labels", {}).get(LABEL_FARM) != self.farm_id and c["Id"] not in adopted]
        await asyncio.gather(*(asyncio.to_thread(self._remove, c["Id"]) for c in victims))
        stale = await remove_stale_dirs(self.shared_dir, self._containers)
        if victims or stale:
            log.warning("reaped orphan containers=%d stale_dirs=%d scope=%s", len(victims), stale, self.scope)
        return len(victims)

    async def adopt(self, handle: DesktopHandle) -> DesktopHandle | None:
        """Take over the container a previous farm of this scope started for ``handle`` (the farm
        restarted; docker kept the container running). None when it is gone, stopped, or not the
        one the handle names: the caller ends its lease."""
        from docker.errors import DockerException, NotFound

        cid = handle.info.get("container")
        if self._closed or not cid or handle.provider != self.name:
            return None
        try:
            attrs = await asyncio.to_thread(self.client.api.inspect_container, cid)
        except NotFound:
            return None
        except DockerException as e:
            raise ProviderError(f"docker daemon error while taking over {handle.info.get('name')}: {e}") from e
        labels = attrs.get("Config", {}).get("Labels") or {}
        if (labels.get(LABEL_SCOPE) != self.scope or labels.get(LABEL_DESKTOP) != handle.id
                or attrs.get("State", {}).get("Status") != "running"):
            return None
        run = handle.info.get("dir")
        if not run or not Path(run).is_dir():
            return None  # its socket and token are gone with the run dir
        self._containers[handle.id] = attrs["Id"]
        if handle.info.get("network") == "host":
            with contextlib.suppress(ValueError):
                self._host_displays[f"{handle.id}/{handle.info.get('gen')}"] = int(handle.info.get("display", ""))
        handle.pid = attrs.get("State", {}).get("Pid") or None
        self.warm.adopted(handle)
        log.info("docker desktop taken over id=%s container=%s", handle.id, handle.info.get("name"))
        return handle

    async def start(self, desktop_id: str, spec: DesktopSpec) -> DesktopHandle:
        if self._closed:
            raise ProviderError("docker provider is closed")
        check_desktop_id(desktop_id)
        t0 = time.monotonic()
        gen = secrets.token_hex(4)
        token = secrets.token_urlsafe(24)
        run = self._make_run_dir(desktop_id, gen, token)
        port = None
        display = 0
        if self.network == "host":
            port = free_loopback_port()
            display = self._host_display()
            self._host_displays[f"{desktop_id}/{gen}"] = display
        created = asyncio.ensure_future(
            asyncio.to_thread(self._run_container, desktop_id, gen, spec, run, port, display)
        )
        try:
            container = await asyncio.shield(created)
        except asyncio.CancelledError:
            # The thread goes on creating the container: wait for it and remove it, or it leaks.
            with contextlib.suppress(Exception):
                leaked = await created
                await asyncio.to_thread(self._remove, leaked.id)
            await asyncio.to_thread(shutil.rmtree, run, True)
            raise
        except Exception as e:
            await asyncio.to_thread(shutil.rmtree, run, True)
            self._host_displays.pop(f"{desktop_id}/{gen}", None)
            raise ProviderError(f"desktop {desktop_id}: docker could not start a container of {self.image}: {e}") from e
        if port is None:
            # The farm takes the socket out of the run dir once the guest listens (SocketClaim).
            endpoint = GuestEndpoint(base_url="http://guest", token=token, uds=str(run.with_name(f"{gen}.sock")))
        else:
            endpoint = GuestEndpoint(base_url=f"http://127.0.0.1:{port}", token=token)
        handle = DesktopHandle(
            id=desktop_id, provider=self.name, spec=spec, endpoint=endpoint,
            info={"container": container.id, "name": container.name, "image": self.image,
                  "image_id": self.image_id, "dir": str(run), "network": self.network, "gen": gen,
                  "display": str(display)},
        )  # fmt: skip
        self._containers[desktop_id] = container.id
        async with discarded_on_failure(desktop_id, lambda: self._discard(handle)):
            await self._wait_ready(handle, t0)
            attrs = await asyncio.to_thread(self.client.api.inspect_container, container.id)
            handle.pid = attrs["State"].get("Pid") or None
        handle.info["start_s"] = f"{time.monotonic() - t0:.3f}"
        await self.warm.after_cold_start(handle, lambda: self._discard(handle))
        log.info("docker desktop ready id=%s container=%s start_s=%s", desktop_id, container.name,
                 handle.info["start_s"])
        return handle

    async def _wait_ready(self, handle: DesktopHandle, t0: float) -> None:
        cid, name = handle.info["container"], handle.info["name"]

        async def container_ended() -> str | None:
            state = (await asyncio.to_thread(self.client.api.inspect_container, cid))["State"]
            if state.get("Status") in ("created", "running"):
                return None
            return f"container {name} {state.get('Status')} (exit code {state.get('ExitCode')})"

        async def container_log() -> str:
            return f"container {name} log:\n{await asyncio.to_thread(self._logs, cid)}"

        claim = None
        if handle.endpoint.uds:
            run = Path(handle.info["dir"])
            claim = SocketClaim(run / "guest.sock", Path(handle.endpoint.uds),
                                GUEST_UID if os.geteuid() == 0 else None, ready=run / "state.json")
        await wait_guest_ready(handle, t0 + self.settings.start_timeout_s, self.settings.start_timeout_s,
                               box_gone=container_ended, box_log=container_log, check_box_every_s=STATE_POLL_S,
                               claim=claim)

    async def _discard(self, handle: DesktopHandle) -> None:
        """Remove a handle's container and run dir (blocking work in threads)."""
        cid = handle.info.get("container")
        if cid:
            self._cgroups.pop(cid, None)
            if self._containers.get(handle.id) == cid:
                self._containers.pop(handle.id, None)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._remove, cid)
        self._host_displays.pop(f"{handle.id}/{handle.info.get('gen')}", None)
        run = handle.info.get("dir")
        if run:
            await asyncio.to_thread(shutil.rmtree, run, True)
        if handle.endpoint.uds:
            with contextlib.suppress(OSError):
                os.unlink(handle.endpoint.uds)

    async def stop(self, handle: DesktopHandle) -> None:
        await self._discard(handle)
        ddir = self.shared_dir / handle.id
        if handle.id not in self._containers:
            self.warm.forget(handle.id)
            with contextlib.suppress(OSError):
                ddir.rmdir()  # only when empty: a newer box of this id may live there
        log.info("docker desktop stopped id=%s", handle.id)

    async def reset(self, handle: DesktopHandle) -> DesktopHandle:
        """``reset_mode`` warm: the same container put back by its guest (see the module doc),
        else (and where that fails, or at once where the container is not :meth:`alive`)
        :meth:`_replace`."""
        problem = None
        if self.warm.enabled:  # a dead container is replaced at once (an inspect: a few ms)
            problem = await self.alive(handle) if handle.pid else "the container has no pid"
        return await self.warm.reset(handle, problem, self._replace)

    async def _replace(self, handle: DesktopHandle) -> DesktopHandle:
        """A new container from the image, started while the old one is removed."""
        old = asyncio.create_task(self._discard(handle))
        try:
            return await self.start(handle.id, handle.spec)
        finally:
            await old

    async def alive(self, handle: DesktopHandle) -> str | None:
        from docker.errors import DockerException, NotFound

        cid = handle.info.get("container", "")
        if self._containers.get(handle.id) != cid:
            return "container is not this provider's current box for the desktop (stopped or replaced)"
        try:
            state = (await asyncio.to_thread(self.client.api.inspect_container, cid))["State"]
        except NotFound:
            return f"container {handle.info.get('name')} is gone"
        except DockerException as e:
            return f"docker daemon error while checking {handle.info.get('name')}: {e}"
        if state.get("OOMKilled"):
            return (f"container {handle.info.get('name')}: memory limit {self.settings.docker_memory} reached "
                    "(out of memory)")
        if state.get("Status") != "running":
            tail = await asyncio.to_thread(self._logs, cid, 3)
            return (f"container {handle.info.get('name')} {state.get('Status')} "
                    f"(exit code {state.get('ExitCode')}): {tail}")
        # A limit hit that docker does not report (the kernel killed a process other than the
        # container's first, a fork was refused): ends the desktop, naming the limit.
        cgroup = self._cgroup(handle)
        hit = cgroup.limit_hit() if cgroup is not None else None
        return f"container {handle.info.get('name')}: {hit}" if hit else None

    def _cgroup(self, handle: DesktopHandle) -> DesktopCgroup | None:
        """The cgroup(s) docker put the handle's container in (found once), or None."""
        cid = handle.info.get("container", "")
        cgroup = self._cgroups.get(cid)
        if cgroup is None and handle.pid and self._containers.get(handle.id) == cid:
            cgroup = DesktopCgroup.of_process(handle.pid, self.limits)
            if cgroup is not None:
                self._cgroups[cid] = cgroup
        return cgroup

    def cpu_seconds(self, handle: DesktopHandle) -> float | None:
        """CPU-seconds of the container since it started: its cgroup's accounting (every process
        that ever ran in it), else its process tree."""
        cgroup = self._cgroup(handle)
        used = cgroup.cpu_seconds() if cgroup is not None else None
        return used if used is not None else tree_cpu_seconds(self.pids(handle))

    def pids(self, handle: DesktopHandle) -> list[int]:
        """Host pids of the container's processes (docker-init and its descendants); empty when
        this farm cannot see the host's pids (e.g. it runs in a container itself)."""
        if not handle.pid or self._containers.get(handle.id) != handle.info.get("container"):
            return []
        try:
            root = psutil.Process(handle.pid)
            with open(f"/proc/{handle.pid}/cgroup") as f:
                if handle.info["container"] not in f.read():
                    return []  # the pid is not the container's (another pid namespace)
            return [root.pid, *(c.pid for c in root.children(recursive=True))]
        except (psutil.Error, OSError):
            return []

    async def stop_all(self) -> None:
        """Remove every container of this provider (not part of the protocol: tests, shutdown):
        those it started, and those it took over (``adopt``: they carry the earlier farm's id)."""
        flt = {"label": [f"{LABEL_SCOPE}={self.scope}", f"{LABEL_FARM}={self.farm_id}"]}
        found = await asyncio.to_thread(self.client.api.containers, all=True, filters=flt)
        ids = {c["Id"] for c in found} | set(self._containers.values())
        await asyncio.gather(*(asyncio.to_thread(self._remove, cid) for cid in ids))
        for desktop_id in list(self._containers):
            self._containers.pop(desktop_id, None)
            await asyncio.to_thread(shutil.rmtree, self.shared_dir / desktop_id, True)

    async def close(self) -> None:
        """Release the shared dir lock and the daemon connection (boxes are the pool's to stop;
        any left are reaped by the next farm of this scope)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.client.close)
