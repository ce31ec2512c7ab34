"""What the host gives the libvirt provider: the connection to libvirtd and the accelerator,
KVM where ``/dev/kvm`` can run our VMs, else TCG emulation (with a warning, and a start timeout
long enough for a VM that boots in minutes).

``libvirt`` (the binding) comes in as an argument: the provider imports it lazily, so that
importing osfarm never needs it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from osfarm.host_kvm import kvm_usable
from osfarm.providers.base import ProviderError

# The libvirt provider's log: these are its warnings.
log = logging.getLogger("osfarm.providers.libvirt")

TCG_MIN_START_TIMEOUT_S = 900.0


def connect(lv: Any, uri: str) -> Any:
    """A connection to libvirt at ``uri`` (``lv``: the libvirt module); ProviderError says how
    to start the daemons."""
    try:
        conn = lv.open(uri)
    except lv.libvirtError as e:
        raise ProviderError(
            f"cannot connect to libvirt at {uri}: {e.get_error_message()}. Start the daemons "
            "(`sudo bash scripts/setup-libvirt.sh`, or `systemctl start libvirtd virtlogd`) "
            "or set OSFARM_LIBVIRT_URI"
        ) from None
    if conn is None:
        raise ProviderError(f"cannot connect to libvirt at {uri}")
    return conn


def pick_accel(lv: Any, conn: Any) -> str:
    """The domain type the VMs run as: ``kvm``, or ``qemu`` (TCG) where KVM is not usable or
    ``OSFARM_LIBVIRT_ACCEL=tcg`` asks for it."""
    forced = os.environ.get("OSFARM_LIBVIRT_ACCEL", "auto")
    if forced not in ("auto", "kvm", "tcg"):
        raise ProviderError(f"OSFARM_LIBVIRT_ACCEL={forced!r}: use auto, kvm or tcg")
    if forced == "kvm":
        return "kvm"
    why = kvm_usable() if forced == "auto" else "OSFARM_LIBVIRT_ACCEL=tcg"
    if why is None:
        try:
            conn.getDomainCapabilities(None, "x86_64", None, "kvm", 0)
            return "kvm"
        except lv.libvirtError as e:
            why = f"libvirt cannot use KVM: {e.get_error_message()}"
    log.warning("KVM is not usable (%s): desktop VMs run under TCG emulation, many times slower", why)
    return "qemu"


def start_timeout_s(domain_type: str, configured_s: float) -> float:
    """The farm's start timeout for VMs of ``domain_type``: under TCG a desktop VM boots in
    minutes, and the farm's timeout (sized for boxes that start in seconds) would fail every start."""
    if domain_type != "kvm" and configured_s < TCG_MIN_START_TIMEOUT_S:
        return TCG_MIN_START_TIMEOUT_S
    return configured_s
