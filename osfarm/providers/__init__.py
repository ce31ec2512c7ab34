"""Desktop providers: how a desktop box is made. ``make_provider`` picks one from settings."""

from __future__ import annotations

from osfarm.config import FarmSettings
from osfarm.providers.base import (
    DesktopHandle,
    DesktopSpec,
    GuestEndpoint,
    Provider,
    ProviderError,
)

__all__ = ["DesktopHandle", "DesktopSpec", "GuestEndpoint", "Provider", "ProviderError", "make_provider"]


def make_provider(settings: FarmSettings) -> Provider:
    """The provider named by ``settings.provider``; raises ProviderError saying what is missing."""
    if settings.provider == "sandbox":
        # Imported here so that importing osfarm.providers never needs psutil or the box tools.
        from osfarm.providers.sandbox import SandboxProvider

        return SandboxProvider(settings)
    if settings.provider == "docker":
        from osfarm.providers.docker import DockerProvider

        return DockerProvider(settings)
    if settings.provider == "libvirt":
        from osfarm.providers.libvirt import LibvirtProvider

        return LibvirtProvider(settings)
    raise ProviderError(f"unknown provider {settings.provider!r}; available: sandbox, docker, libvirt")
