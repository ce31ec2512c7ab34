"""The settings a test or bench gives each provider here (``sandbox``, ``docker``, ``libvirt``),
with the provider's image or VM disk built first when missing (``docker_env.ensure_images``,
then the libvirt disk, cached per machine by the desktop recipe's label)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from osfarm.images.libvirt_disk import build_libvirt_disk, default_image_dir
from osfarm.testing.docker_env import ensure_images

VM_DISK_DIR = Path(os.environ.get("OSFARM_LIBVIRT_IMAGE_DIR") or default_image_dir())


def provider_options(name: str) -> dict[str, Any]:
    """The settings of provider ``name`` here; its image or disk is built first when missing."""
    if name == "docker":
        ensure_images("desktop")
        return {"provider": name, "docker_memory": "2g", "docker_cpus": 2.0}
    if name == "libvirt":
        ensure_images("desktop")
        build_libvirt_disk(VM_DISK_DIR)  # once per machine: cached by the desktop recipe label
        return {"provider": name, "libvirt_image_dir": VM_DISK_DIR, "libvirt_memory_mb": 2048}
    return {"provider": name}
