"""Whether this host's KVM can run osfarm's desktop VMs.

Layer-neutral: the libvirt provider picks its accelerator with it, and the settings pick the
libvirt provider's default desktop with it (GNOME where VMs run under KVM; the light desktop
under TCG emulation, where GNOME Shell is slow to start and once died during a task's setup).
"""

from __future__ import annotations

import os


def kvm_usable() -> str | None:
    """None when /dev/kvm can run our VMs, else why not."""
    if not os.path.exists("/dev/kvm"):
        return "/dev/kvm does not exist (no hardware virtualisation, or the kvm module is not loaded)"
    if os.path.isdir("/sys/module/kvm_pvm"):
        # PVM (nested virtualisation without hardware support) only runs guest kernels built
        # for it; a stock Debian kernel hangs right after its decompressor.
        return "/dev/kvm is KVM-PVM, which boots only PVM guest kernels"
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"/dev/kvm cannot be opened: {e.strerror} (add this user to the kvm group)"
    os.close(fd)
    return None


def vms_run_under_kvm() -> bool:
    """What the libvirt provider will choose, as far as it can be known without libvirt: KVM
    unless ``OSFARM_LIBVIRT_ACCEL=tcg`` or /dev/kvm cannot run our VMs."""
    accel = os.environ.get("OSFARM_LIBVIRT_ACCEL", "auto")
    return accel == "kvm" or (accel != "tcg" and kvm_usable() is None)
