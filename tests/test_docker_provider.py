"""DockerProvider specifics (the shared behaviours are in test_provider_conformance.py): clear
errors at construction, container replacement on reset, host networking, one farm per scope."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from osfarm.config import FarmSettings
from osfarm.providers.base import DesktopSpec, ProviderError
from osfarm.testing.docker_env import containers, docker_or_skip, ensure_images

SPEC = DesktopSpec(width=800, height=600)
# The first test to need the images builds them when missing (about 10-15 min on a fresh 2-core
# machine; CI builds them before pytest with `osfarm image build`).
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture
def state_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="ofd", dir="/tmp") as d:
        yield d


def settings(state_dir: str, **kw: object) -> FarmSettings:
    return FarmSettings(provider="docker", state_dir=state_dir, **kw)  # type: ignore[arg-type]


def test_daemon_not_running_says_how_to_start_it(state_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from osfarm.providers.docker import DockerProvider

    monkeypatch.setenv("DOCKER_HOST", f"unix://{state_dir}/no-docker.sock")
    with pytest.raises(ProviderError, match="not running.*setup-docker.sh"):
        DockerProvider(settings(state_dir))


def test_missing_image_says_osfarm_image_build(state_dir: str) -> None:
    from osfarm.providers.docker import DockerProvider

    docker_or_skip()
    with pytest.raises(ProviderError, match=r"osfarm/nosuch:0 is missing.*osfarm image build"):
        DockerProvider(settings(state_dir, docker_image="osfarm/nosuch:0"))


def test_serve_refuses_to_start_without_the_image(state_dir: str) -> None:
    docker_or_skip()
    env = dict(os.environ, OSFARM_STATE_DIR=state_dir, OSFARM_DOCKER_IMAGE="osfarm/nosuch:0")
    r = subprocess.run([sys.executable, "-m", "osfarm.cli", "serve", "--provider", "docker", "--port", "0"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "osfarm image build" in r.stderr and "Traceback" not in r.stderr, r.stderr


async def test_one_farm_per_shared_dir(state_dir: str) -> None:
    from osfarm.providers.docker import DockerProvider

    ensure_images("desktop")
    first = DockerProvider(settings(state_dir))
    try:
        with pytest.raises(ProviderError, match="another osfarm process is using docker_shared_dir"):
            DockerProvider(settings(state_dir))
    finally:
        await first.close()


def test_dockerfile_has_the_providers_ids() -> None:
    """The image's osfarm-guest account and the agent's id range are the provider's constants."""
    from osfarm.images.recipes import DESKTOP_AGENT_BASE, DESKTOP_GUEST_UID, DESKTOP_HOME_TEMPLATE

    text = (Path(__file__).resolve().parent.parent / "vm_images" / "desktop" / "Dockerfile").read_text()
    assert f"-u {DESKTOP_GUEST_UID} -g osfarm-guest" in text and f"groupadd -g {DESKTOP_GUEST_UID} osfarm-guest" in text
    assert f"cp -a /home/user {DESKTOP_HOME_TEMPLATE}" in text
    assert not DESKTOP_AGENT_BASE <= DESKTOP_GUEST_UID < DESKTOP_AGENT_BASE + 65536


async def test_reset_replaces_the_container(state_dir: str) -> None:
    from osfarm.providers.docker import CAPS, DockerProvider

    ensure_images("desktop")
    # cold: this test is about the container replace (a new container, the old one removed);
    # test_warm_reset_keeps_the_container is the default's (warm) test
    p = DockerProvider(settings(state_dir, docker_memory="1g", docker_cpus=1.0, reset_mode="cold"))
    h1 = await p.start("rep1", SPEC)
    try:
        attrs = p.client.api.inspect_container(h1.info["container"])
        assert attrs["HostConfig"]["Init"] is True
        assert attrs["HostConfig"]["Memory"] == 2**30 and attrs["HostConfig"]["NanoCpus"] == 10**9
        assert attrs["HostConfig"]["NetworkMode"] == "none"
        # containment (docs/security.md): root only for the box's init, with five capabilities,
        # osfarm's seccomp profile, a process limit, size-capped tmpfs for the home and /tmp
        assert attrs["Config"]["User"] == "0:0" and attrs["HostConfig"]["CapDrop"] == ["ALL"]
        assert sorted(attrs["HostConfig"]["CapAdd"]) == sorted(f"CAP_{c}" for c in CAPS) or \
            sorted(attrs["HostConfig"]["CapAdd"]) == sorted(CAPS)
        assert any(o.startswith("seccomp=") for o in attrs["HostConfig"]["SecurityOpt"])
        assert attrs["HostConfig"]["PidsLimit"] == p.settings.docker_pids
        assert set(attrs["HostConfig"]["Tmpfs"]) == {"/home/user", "/tmp", "/var/tmp"}
        assert attrs["Config"]["Labels"]["org.osfarm.desktop"] == "rep1"
        assert attrs["Config"]["Labels"]["org.osfarm.farm"] == p.farm_id
        assert h1.endpoint.uds and Path(h1.endpoint.uds).exists()
        h2 = await p.reset(h1)
        assert h2.info["container"] != h1.info["container"]
        assert await p.alive(h2) is None
        assert await p.alive(h1) is not None  # the old handle is no longer the desktop's box
        names = containers(f"org.osfarm.farm={p.farm_id}")
        assert names == [h2.info["name"]], names
        assert not Path(h1.info["dir"]).exists()
        await p.stop(h2)
        assert containers(f"org.osfarm.farm={p.farm_id}") == []
        assert not (Path(p.shared_dir) / "rep1").exists()
    finally:
        await p.stop_all()
        await p.close()


async def test_host_network_guest_on_a_loopback_port(state_dir: str) -> None:
    from osfarm.providers.docker import DockerProvider
    from osfarm.tasks.controller import GuestController

    ensure_images("desktop")
    p = DockerProvider(settings(state_dir, docker_network="host"))
    h = await p.start("host1", SPEC)
    try:
        assert h.endpoint.uds is None and h.endpoint.base_url.startswith("http://127.0.0.1:")
        async with h.endpoint.client() as c:
            r = await c.get("/v1/observation", params={"screenshot": "false"})
            assert r.status_code == 200 and r.json()["screen"] == {"width": 800, "height": 600}, r.text
        ctl = GuestController.from_endpoint(h.endpoint)
        try:
            out = await asyncio.to_thread(ctl.execute, ["bash", "-c", "id -un; echo $DISPLAY"])
        finally:
            ctl.close()
        assert "user" in str(out), out
    finally:
        await p.stop(h)
        await p.close()


DIRTY = r"""
import os, subprocess
open(os.path.expanduser("~/Desktop/dirty.txt"), "w").write("x")
subprocess.Popen(["sh", "-c", "(sleep 1000 &) ; exit 0"])  # a double-forked daemon
OWNER = ("from Xlib import display, X; import time; d = display.Display(); "
         "w = d.screen().root.create_window(0, 0, 1, 1, 0, 0); "
         "w.set_selection_owner(d.intern_atom('CLIPBOARD'), X.CurrentTime); d.flush(); time.sleep(1000)")
subprocess.Popen(["python3", "-c", OWNER])
"""
SUDO = r"""
import subprocess
subprocess.run(["sudo", "-S", "mount", "-t", "tmpfs", "none", "/mnt"], input=b"password\n", check=True)
"""


async def test_warm_reset_keeps_the_container(state_dir: str) -> None:
    """reset_mode warm: a dirtied desktop (home file, daemon, clipboard) is put back in the same
    container with a new token and the cold start's fingerprint, also after a farm restart (adopt);
    a change made with sudo shows in the fingerprint and the container is replaced instead."""
    from osfarm.desktop.warm.fingerprint_diff import differences
    from osfarm.providers.docker import DockerProvider

    ensure_images("desktop")

    async def guest(h, method: str, path: str, **kw: object) -> dict:  # noqa: ANN001
        async with h.endpoint.client(timeout=60) as c:
            r = await c.request(method, path, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    p = DockerProvider(settings(state_dir, reset_mode="warm"))
    h = await p.start("warm1", SPEC)
    try:
        cold = await guest(h, "GET", "/v1/session/fingerprint")
        assert cold["digest"] == h.info["warm_digest"] and any(r.startswith("box ") for r in cold["processes"])
        assert (await guest(h, "POST", "/v1/pyautogui", json={"code": DIRTY}))["ok"]
        dirty = await guest(h, "GET", "/v1/session/fingerprint")
        for _ in range(60):  # the action returns at once (settle): the clipboard owner it launched starts after it
            if dirty["x"]["selections"]["CLIPBOARD"]:
                break
            await asyncio.sleep(0.5)
            dirty = await guest(h, "GET", "/v1/session/fingerprint")
        assert dirty["digest"] != cold["digest"] and dirty["x"]["selections"]["CLIPBOARD"]
        cpu = p.cpu_seconds(h)
        assert cpu is not None and cpu > 0
        h2 = await p.reset(h)
        assert h2.info["reset_mode"] == "warm" and "reset_fallback" not in h2.info, h2.info
        assert h2.info["container"] == h.info["container"] and h2.endpoint.token != h.endpoint.token
        fp = await guest(h2, "GET", "/v1/session/fingerprint")
        assert fp["digest"] == cold["digest"], differences(cold, fp)
        assert p.cpu_seconds(h2) >= cpu
        async with h.endpoint.client() as c:  # the old token no longer opens the guest
            assert (await c.get("/v1/session/fingerprint")).status_code == 401
        out = await guest(h2, "POST", "/v1/pyautogui", json={"code": SUDO})
        assert out["ok"], out
        h3 = await p.reset(h2)
        assert h3.info["reset_mode"] == "cold" and h3.info["reset_fallback_kind"] == "mismatch", h3.info
        assert "/mnt" in h3.info["reset_fallback"]
        assert h3.info["container"] != h2.info["container"]
        cold3 = await guest(h3, "GET", "/v1/session/fingerprint")
        # a farm restart: the next farm takes the container over and can still reset it warm
        await p.close()
        p = DockerProvider(settings(state_dir, reset_mode="warm"))
        h4 = await p.adopt(h3)
        assert h4 is not None
        assert (await guest(h4, "POST", "/v1/pyautogui", json={"code": DIRTY}))["ok"]
        h5 = await p.reset(h4)
        assert h5.info["reset_mode"] == "warm" and h5.info["container"] == h3.info["container"], h5.info
        fp = await guest(h5, "GET", "/v1/session/fingerprint")
        assert fp["digest"] == h3.info["warm_digest"], differences(cold3, fp)
        await p.stop_all()  # the adopted container too (it carries the first farm's id)
        assert not p.client.containers.list(all=True, filters={"label": f"org.osfarm.scope={p.scope}"})
    finally:
        await p.stop_all()
        await p.close()
