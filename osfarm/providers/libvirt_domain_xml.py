"""What a desktop VM is, as libvirt is told: the domain XML, filled in from
``vm_images/libvirt/domain.xml``, and what goes into it: the kernel command line, the box plan
the VM's init reads through fw_cfg, qemu's user network with its host forward on loopback, the
domain's name, and osfarm's ``<metadata>``, which a restarted farm reads back to tell its own
domains from others'.

No libvirt call and no host state here: :mod:`osfarm.providers.libvirt` fills the template from
its settings, the disk it found and the account qemu runs as.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import xml.etree.ElementTree as ET
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

from osfarm.config import FarmSettings
from osfarm.desktop.box.agent_world import AgentWorldSpec
from osfarm.desktop.box.box_init import BoxPlan
from osfarm.desktop.session import gnome
from osfarm.desktop.session.session import home_files
from osfarm.images.recipes import (
    DESKTOP_AGENT_BASE,
    DESKTOP_GUEST_UID,
    DESKTOP_HOME_TEMPLATE,
)
from osfarm.providers.base import DesktopSpec
from osfarm.providers.cgroups import parse_size

METADATA_NS = "https://osfarm.dev/libvirt/desktop/1"
METADATA_KEY = "osfarm"
GUEST_PORT = 8000
TEMPLATE_NAME = "domain.xml"
DOMAIN_PREFIX = "osfarm-"
FW_CFG_TOKEN = "opt/org.osfarm/token"
FW_CFG_PLAN = "opt/org.osfarm/plan"
# The VM's disk is the Docker desktop image's: its accounts and paths.
IMAGE_GUEST_UID = DESKTOP_GUEST_UID
IMAGE_AGENT_BASE = DESKTOP_AGENT_BASE
IMAGE_HOME_TEMPLATE = DESKTOP_HOME_TEMPLATE
VM_PYTHON = "/opt/osfarm/bin/python"
VM_PATH = "/opt/osfarm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def domain_template_path() -> Path:
    env = os.environ.get("OSFARM_VM_IMAGES")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "vm_images"
    return root / "libvirt" / TEMPLATE_NAME


def kernel_cmdline(spec: DesktopSpec, home_bytes: int = 1 << 30, tmp_bytes: int = 512 << 20) -> str:
    """Kernel command line of a desktop VM: root disk, our init, the session's settings and the
    sizes of the home and /tmp tmpfs (no secret: the token goes through fw_cfg)."""
    return " ".join(
        [
            "root=/dev/vda", "rw", "rootfstype=ext4", "init=/sbin/osfarm-init",
            "console=ttyS0", "quiet", "loglevel=3", "tsc=reliable", "no_timer_check",
            "random.trust_cpu=on", "8250.nr_uarts=1", "mitigations=off",
            f"osfarm.width={spec.width}", f"osfarm.height={spec.height}",
            f"osfarm.depth={spec.depth}", f"osfarm.port={GUEST_PORT}",
            f"osfarm.home_size={home_bytes}", f"osfarm.tmp_size={tmp_bytes}",
        ]
    )  # fmt: skip


def vm_plan(spec: DesktopSpec) -> BoxPlan:
    """What the VM's init (as the VM's root) does before the session: as the Docker desktop's
    (the VM's disk is that image's), the guest listening on the VM's network for the host forward."""
    args = ["--width", str(spec.width), "--height", str(spec.height), "--depth", str(spec.depth),
            "--desktop", spec.desktop,
            "--display", ":0", "--host", "0.0.0.0", "--port", str(GUEST_PORT), "--allow-non-loopback",
            "--token-file", "/run/osfarm/token", "--state-file", "/run/osfarm/state.json",
            "--run-dir", "/run/osfarm", "--home", "/home/user"]
    env = {"PATH": VM_PATH, "HOME": "/home/user", "USER": "osfarm-guest", "LANG": "C.UTF-8",
           "PYTHONUNBUFFERED": "1", "OSFARM_PYTHON": VM_PYTHON,
           "XDG_CACHE_HOME": "/run/osfarm/cache", "XDG_CONFIG_HOME": "/run/osfarm/config", **spec.extra_env}
    agent = AgentWorldSpec(guest_uid=IMAGE_GUEST_UID, guest_gid=IMAGE_GUEST_UID, outside_base=IMAGE_AGENT_BASE,
                           password_hash="", hostname="osfarm-vm")
    return BoxPlan(
        launcher=[VM_PYTHON, "-m", "osfarm.desktop.launch.launcher", *args], env=env,
        guest_uid=IMAGE_GUEST_UID, guest_gid=IMAGE_GUEST_UID, run_dir="/run/osfarm",
        home="/home/user", home_uid=IMAGE_AGENT_BASE + 1000, home_gid=IMAGE_AGENT_BASE + 1000,
        home_template=IMAGE_HOME_TEMPLATE, home_files=home_files(spec.desktop),
        etc_files=gnome.timezone_files(spec.timezone) if spec.desktop == "gnome" else {}, agent=agent, cwd="/home/user",
    )  # fmt: skip


def netdev_arg(host_port: int, private_network: bool) -> str:
    """qemu user networking; the host forward is bound to loopback only. ``restrict=on`` cuts
    the guest off from the host and the outside (the forward still works)."""
    restrict = "on" if private_network else "off"
    return f"user,id=osfarmnet0,restrict={restrict},hostfwd=tcp:127.0.0.1:{host_port}-:{GUEST_PORT}"


def domain_name(state_dir: Path, desktop_id: str) -> str:
    """Unique per farm state dir, so that two farms on one libvirtd never clash."""
    digest = hashlib.sha256(str(state_dir).encode()).hexdigest()[:8]
    return f"{DOMAIN_PREFIX}{digest}-{desktop_id}"


def read_metadata(xml_text: str) -> dict[str, str] | None:
    """Our metadata of a domain (from its XML), or None when it is not an osfarm domain."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return None
    node = root.find(f"metadata/{{{METADATA_NS}}}desktop")
    if node is None:
        return None
    return {child.tag.split("}", 1)[-1]: (child.text or "") for child in node}


def domain_xml(template: Template, *, domain_type: str, settings: FarmSettings, state_dir: Path, desktop_id: str,
               ddir: Path, spec: DesktopSpec, port: int, files: dict[str, Path], qemu_uid: int, qemu_gid: int) -> str:
    """The domain XML of desktop ``desktop_id`` (its files in ``ddir``), its guest forwarded to
    ``127.0.0.1:port``, for the accelerator ``domain_type`` (``kvm`` or ``qemu``: TCG)."""
    if domain_type == "kvm":
        # arch-capabilities off: nested KVM hosts often refuse its MSR (qemu aborts at start).
        cpu = ("<cpu mode='host-passthrough' check='none' migratable='off'>"
               "<feature policy='disable' name='arch-capabilities'/></cpu>")
    else:
        # Every feature TCG can emulate: wheels such as numpy need at least x86-64-v2, which
        # the default qemu64 model lacks (the session dies with SIGILL).
        cpu = "<cpu mode='maximum' check='none'/>"
    mac = "52:54:00:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(3))
    values = {
        "domain_type": domain_type,
        "name": domain_name(state_dir, desktop_id),
        "metadata_ns": METADATA_NS,
        "desktop_id": desktop_id,
        "state_dir": str(state_dir),
        "host_port": str(port),
        "guest_port": str(GUEST_PORT),
        "owner_pid": str(os.getpid()),
        "memory_mb": str(settings.libvirt_memory_mb),
        "vcpus": str(settings.libvirt_vcpus),
        "kernel": str(files["kernel"]),
        "initrd": str(files["initrd"]),
        "cmdline": kernel_cmdline(spec, parse_size(settings.sandbox_home_size), parse_size(settings.sandbox_tmp_size)),
        "uid": str(qemu_uid),
        "gid": str(qemu_gid),
        "token_file": str(ddir / "token"),
        "plan_file": str(ddir / "plan.json"),
        "fw_cfg_token": FW_CFG_TOKEN,
        "fw_cfg_plan": FW_CFG_PLAN,
        "overlay": str(ddir / "disk.qcow2"),
        "console_log": str(ddir / "console.log"),
        "netdev": netdev_arg(port, spec.private_network),
        "mac": mac,
    }
    escaped = {k: escape(v, {"'": "&apos;", '"': "&quot;"}) for k, v in values.items()}
    escaped["cpu"] = cpu
    return template.substitute(escaped)
