"""Farm settings: defaults < config file (YAML, ``--config`` or ``OSFARM_CONFIG``) < ``OSFARM_*``
environment variables < command-line flags."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from osfarm.errors import OsfarmError
from osfarm.host_kvm import vms_run_under_kvm


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "osfarm"


class ConfigError(OsfarmError, ValueError):
    """A config file or value is wrong; the message names the file and the key."""


class FarmSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OSFARM_", extra="forbid")

    host: str = Field(default="127.0.0.1", description="address the farm API binds (loopback by default)")
    port: int = Field(default=8765, ge=0, le=65535)
    token: str = Field(default="", description="the admin bearer token of the farm API; generated when empty")
    tokens_file: Path | None = Field(
        default=None, description="per-client tokens: a YAML file of {name, role, sha256, max_leases, max_ttl_s} "
        "entries (osfarm tokens add); see osfarm/http/principals.py",
    )
    tokens: str = Field(
        default="", description="per-client tokens as a list: "
        "name:role:token-or-sha256:<hex>[:max_leases[:max_ttl_s]], comma-separated (OSFARM_TOKENS)",
    )
    client_max_leases: int | None = Field(
        default=None, ge=1, description="lease quota of a client token without its own"
    )
    client_max_ttl_s: float | None = Field(
        default=None, gt=0, description="longest lease TTL of a client token without its own"
    )
    max_body_bytes: int = Field(
        default=16 << 20, ge=1024, description="largest request body of the farm API (413 above)"
    )
    server_loop: Literal["asyncio", "uvloop"] = Field(
        default="asyncio", description="the farm API's event loop. asyncio accepts every waiting connection at each "
        "turn of the loop; uvloop accepts one per turn, so under load a burst of new connections waits tens of "
        "seconds in the listen queue (bench/load.py, docs/farm.md)",
    )
    max_upload_bytes: int = Field(
        default=1 << 30, ge=1024, description="largest request body through the guest passthrough (uploads; 413 above)"
    )
    task_cache_dir: Path | None = Field(
        default=None, description="the task routes' file cache (OSWorld layout <dir>/<task id>/<file>, url_map.json); "
        "default <state_dir>/task-cache. file:// and local task paths are only read from here and task_suite_dir",
    )
    task_suite_dir: Path | None = Field(
        default=None,
        description="a suite folder whose files the task routes may upload (relative task paths resolve here)",
    )
    task_offline: bool = Field(
        default=True, description="the task routes never download: a file not in the cache is a 424"
    )
    tls_certfile: Path | None = Field(
        default=None, description="serve HTTPS with this certificate (PEM); with tls_keyfile"
    )
    tls_keyfile: Path | None = Field(default=None, description="the private key of tls_certfile (PEM)")
    ui_runs_dir: Path | None = Field(
        default=None,
        description="a folder of eval/training run dirs the dashboard (/ui) shows; none: live desktops only",
    )
    provider: Literal["sandbox", "docker", "libvirt"] = Field(
        default="sandbox",
        description="how desktops are boxed: sandbox (namespaces + cgroups, no daemon; needs root), docker, libvirt",
    )
    pool_min: int = Field(default=1, ge=0, description="desktops kept warm (ready, unleased)")
    pool_max: int = Field(default=4, ge=1, description="most desktops alive at once")
    lease_ttl_s: float = Field(default=300.0, gt=0, description="a lease expires this long after its last heartbeat")
    idle_stop_s: float = Field(
        default=120.0, gt=0, description="ready desktops above pool_min are stopped after idling this long"
    )
    width: int = Field(default=1920, ge=320, le=7680)
    height: int = Field(default=1080, ge=200, le=4320)
    depth: Literal[16, 24] = 24
    desktop: Literal["gnome", "light"] | None = Field(
        default=None, description="the desktop session. gnome: OSWorld's Ubuntu 22.04 screen (GNOME Shell with "
        "the top bar, the Ubuntu Dock on the left, Yaru, the Ubuntu font; osfarm/desktop/session/gnome.py). "
        "light: openbox with a tint2 panel, the cheapest desktop. "
        "Every lease, results.json row and episode record says which ran. "
        "Default: gnome; light on the libvirt provider where its VMs run under TCG emulation (no usable KVM)",
    )
    desktop_timezone: str = Field(
        default="America/Los_Angeles", pattern=r"^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$",
        description="the GNOME desktop's time zone (/etc/localtime; timedatectl changes it). Not UTC, so that a "
        "task asking for UTC+0 is not done before it starts",
    )
    private_network: bool = Field(
        default=True,
        description="give each sandbox its own network namespace (only loopback): no port or X socket "
        "clashes between desktops; turn off for tasks that need the network",
    )
    state_dir: Path = Field(default_factory=default_state_dir)
    # --- sandbox provider: limits per desktop (docs/security.md) ---
    sandbox_memory: str = Field(default="3g", description="memory limit per sandbox desktop (cgroup); its tmpfs "
                                "(home, /tmp) counts too")
    sandbox_pids: int = Field(default=2048, ge=64, description="most processes and threads per sandbox desktop")
    sandbox_cpu_weight: int = Field(default=100, ge=1, le=10000, description="CPU weight per sandbox desktop "
                                    "(cgroup v2 scale: 100 = an equal share)")
    sandbox_home_size: str = Field(default="1g", description="size cap of a desktop's home, a tmpfs (every provider)")
    sandbox_tmp_size: str = Field(
        default="512m", description="size cap of a desktop's /tmp and /var/tmp (every provider)"
    )
    sandbox_uid_base: int = Field(default=0x70000000, ge=65536, le=0x7FFE0000,
                                  description="first host uid of the sandboxes' uid slots (131072 ids per desktop)")
    sandbox_start: Literal["exec", "fork"] = Field(
        default="exec", description="how a sandbox box starts. exec: a new interpreter per box (unshare + box init + "
        "launcher). fork: from a pre-initialised template process that has imported the guest's server stack once "
        "(osfarm/desktop/launch/box_zygote.py); boxes then share its address-space layout and hash seed "
        "(docs/security.md)",
    )
    health_interval_s: float = Field(default=2.0, gt=0)
    start_timeout_s: float = Field(default=60.0, gt=0)
    # --- reset (sandbox and docker desktops: osfarm/desktop/warm/warm.py; libvirt resets by libvirt_reset) ---
    reset_mode: Literal["warm", "cold"] = Field(
        default="warm", description="warm: end the task's processes and put files and X state back, keeping the "
        "session, kept only where its fingerprint equals the cold start's (else, on an error, past "
        "warm_reset_timeout_s or when the box died, a cold restart, counted); ~5x faster and ~1/3 of the CPU of a "
        "cold one. cold: a new box every reset, the strictest isolation between episodes (docs/security.md: what "
        "the fingerprint cannot see). Sandbox and docker only; libvirt ignores it (libvirt_reset)",
    )
    cold_every: int = Field(
        default=25, ge=0, description="with reset_mode warm: every Nth reset is cold (0: never). A cold restart "
        "bounds what the fingerprint cannot see (X server and window manager memory growth, state outside the "
        "trees it hashes) to N-1 episodes; at 25 it adds ~0.025 CPU-s per episode to a ~0.25 CPU-s warm reset",
    )
    warm_reset_timeout_s: float = Field(default=10.0, gt=0, description="a warm reset that takes longer is "
                                        "abandoned for a cold restart")
    # --- docker provider ---
    docker_image: str = Field(default="osfarm/desktop:latest", description="desktop image (osfarm image build)")
    docker_network: Literal["none", "host"] = Field(
        default="none", description="none: no network, guest on a unix socket; host: host networking, loopback port"
    )
    docker_memory: str = Field(default="3g", description="memory limit per desktop container")
    docker_cpus: float = Field(default=2.0, gt=0, description="CPU limit per desktop container")
    docker_pids: int = Field(default=2048, ge=64, description="most processes and threads per desktop container")
    docker_shared_dir: Path | None = Field(
        default=None,
        description="host dir for the desktops' run dirs (guest sockets); must be the same path in the farm's "
        "container and on the docker host. Default: <state_dir>/docker",
    )
    # --- libvirt provider ---
    libvirt_uri: str = Field(default="qemu:///system")
    libvirt_image_dir: Path | None = Field(
        default=None, description="dir with base.qcow2, vmlinuz, initrd.img (osfarm image build --libvirt)"
    )
    libvirt_memory_mb: int = Field(default=3072, ge=512)
    libvirt_vcpus: int = Field(default=2, ge=1)
    libvirt_reset: Literal["boot", "snapshot"] = Field(
        default="boot", description="boot: fresh overlay + boot; snapshot: revert to a ready internal snapshot"
    )

    @model_validator(mode="after")
    def _desktop_and_zone(self) -> FarmSettings:
        if self.desktop is None:
            # libvirt VMs under TCG emulation get the light desktop: GNOME Shell there is slow to
            # start and once died during a task's setup (docs/osworld-compat.md)
            self.desktop = "light" if self.provider == "libvirt" and not vms_run_under_kvm() else "gnome"
        # a GNOME box's /etc/localtime links to /usr/share/zoneinfo/<zone> (the host's /usr): a
        # zone missing there would silently be UTC in the box
        zone = self.desktop_timezone
        if self.desktop == "gnome" and not Path("/usr/share/zoneinfo", zone).is_file():
            raise ValueError(f"desktop_timezone: {zone!r} is not a time zone of /usr/share/zoneinfo "
                             "(e.g. America/Los_Angeles)")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlFileSource(settings_cls))

    def resolved_task_cache_dir(self) -> Path:
        return self.task_cache_dir if self.task_cache_dir is not None else self.state_dir / "task-cache"

    def ensure_token(self) -> FarmSettings:
        if not self.token:
            self.token = secrets.token_urlsafe(24)
        return self


class _YamlFileSource(PydanticBaseSettingsSource):
    """Reads the file named by OSFARM_CONFIG (set by ``--config``)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("OSFARM_CONFIG")
        if not path:
            return {}
        return load_yaml_config(Path(path))


def load_yaml_config(path: Path) -> dict[str, Any]:
    """The farm settings in a YAML file; an unknown key is an error naming its line."""
    data, text = read_yaml_mapping(path)
    unknown = sorted(set(data) - set(FarmSettings.model_fields))
    if unknown:
        raise ConfigError(f"{path}:{yaml_line(text, (unknown[0],))}: unknown setting {unknown[0]!r}")
    return data


# -- YAML files with errors that name the line (the farm's config, the trainer's train.yaml) ------


def read_yaml_mapping(path: Path, error: type[Exception] = ConfigError) -> tuple[dict[str, Any], str]:
    """The mapping in a YAML file, and the file's text (to find lines in later).

    Raises ``error`` naming ``FILE:LINE`` when the file cannot be read, is not YAML or is not
    a mapping.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise error(f"{path}: cannot read config file: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise error(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise error(f"{path}:1: expected a mapping of settings, got {type(data).__name__}")
    return data, text


def yaml_line(text: str, loc: Sequence[Any]) -> int:
    """The line of the deepest key of ``loc`` (a pydantic error location) found in order in the
    YAML text; 1 when none is found. Keys of list items (``- key:``) count."""
    lines = text.splitlines()
    line = 0
    for key in loc:
        if not isinstance(key, str):
            continue
        for i in range(line, len(lines)):
            if lines[i].lstrip().lstrip("- ").startswith(f"{key}:"):
                line = i
                break
    return line + 1


def validation_message(e: ValidationError, path: Path | str | None, text: str, where: str = "settings") -> str:
    """``FILE:LINE: key.path: message`` for the first error of a model read from a YAML file
    (``where`` instead of ``FILE:LINE`` when there is no file)."""
    err = e.errors()[0]
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    place = f"{path}:{yaml_line(text, loc)}" if path is not None else where
    return f"{place}: {key}: {err['msg']}"


def load_settings(config: Path | None = None, **overrides: Any) -> FarmSettings:
    """Build settings from file + env + explicit overrides; errors name the file, line or variable."""
    if config is not None:
        os.environ["OSFARM_CONFIG"] = str(config)
    try:
        return FarmSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        key = ".".join(str(p) for p in e.errors()[0]["loc"])
        src = os.environ.get("OSFARM_CONFIG")
        text = Path(src).read_text() if src and Path(src).exists() else ""
        message = validation_message(e, src if text else None, text)
        raise ConfigError(f"{message} (env var OSFARM_{key.upper()})") from None
