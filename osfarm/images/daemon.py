"""Connecting to the Docker daemon with errors that say what to do (shared by the image builder
and the Docker provider)."""

from __future__ import annotations

import os
from typing import Any

from osfarm.errors import InfraError

SETUP_HINT = "start it with `bash scripts/setup-docker.sh` (or `dockerd --bridge=none --iptables=false &`)"


class DockerUnavailable(InfraError, RuntimeError):
    """The daemon cannot be used; the message says why and how to fix it."""


def docker_client(timeout: float = 120.0) -> Any:
    """A ``docker.DockerClient`` for DOCKER_HOST (default /var/run/docker.sock) that answered a ping."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:
        raise DockerUnavailable("the docker SDK is not installed: pip install 'osfarm[docker]'") from None
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    sock = host[len("unix://"):] if host.startswith("unix://") else None
    if sock and not os.path.exists(sock):
        raise DockerUnavailable(f"the Docker daemon is not running (no socket {sock}): {SETUP_HINT}")
    if sock and not os.access(sock, os.R_OK | os.W_OK):
        raise DockerUnavailable(
            f"no permission on the Docker socket {sock} (uid {os.getuid()}): run as root or add this user to "
            "the docker group (`usermod -aG docker $USER`, then log in again)"
        )
    try:
        client = docker.from_env(timeout=int(timeout))
        client.ping()
    except DockerException as e:
        text = str(e)
        if "Permission denied" in text:
            raise DockerUnavailable(f"no permission on the Docker socket {sock or host}: {text}") from None
        raise DockerUnavailable(f"the Docker daemon at {host} does not answer ({text}): {SETUP_HINT}") from None
    return client
