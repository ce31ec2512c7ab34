"""Docker for tests: the daemon (skip or, in CI, fail when missing: osfarm.testing.unavailable)
and osfarm's images, built once per process (and once per machine: the builder keeps an image
whose recipe label matches)."""

from __future__ import annotations

import functools
import os
import subprocess
from typing import Any

from osfarm.images.build import ImageBuilder
from osfarm.images.cli import default_work_dir
from osfarm.images.daemon import DockerUnavailable, docker_client
from osfarm.testing.unavailable import unavailable


def docker_or_skip() -> Any:
    """A docker client; outside CI a missing daemon skips the test, in CI it fails it."""
    try:
        return docker_client(timeout=120)
    except DockerUnavailable as e:
        unavailable(f"docker not available: {e}", required_in_ci=True)


@functools.cache
def _build(only: str) -> str:
    builder = ImageBuilder(docker_client(timeout=3600), work_dir=default_work_dir())
    results = builder.build(only=only)
    return "\n".join(f"{r.ref}: {r.status} {r.seconds:.0f}s" for r in results)


def ensure_images(only: str = "desktop") -> str:
    """Build (or find up to date) osfarm's images up to ``only``; returns a one-line-per-image summary."""
    docker_or_skip()
    if os.geteuid() != 0:
        unavailable("building the debootstrap base image needs root")
    return _build(only)


def containers(label: str) -> list[str]:
    """Names of containers (running or not) carrying ``label`` (``key`` or ``key=value``)."""
    out = subprocess.run(["docker", "ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}"],
                         capture_output=True, text=True, check=True).stdout
    return [n for n in out.split() if n]
