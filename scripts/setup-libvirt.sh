#!/usr/bin/env bash
# Start the libvirt daemons the LibvirtProvider needs (qemu:///system), without systemd.
# Idempotent: running daemons are left alone. Used by CI and on machines without systemd;
# with systemd, `systemctl start libvirtd virtlogd` does the same.
#   sudo bash scripts/setup-libvirt.sh            # start daemons, check qemu:///system answers
#   INSTALL=1 sudo bash scripts/setup-libvirt.sh  # apt-get install the packages first
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
  echo "setup-libvirt.sh: run as root (libvirtd for qemu:///system runs as root)" >&2
  exit 1
fi

if [[ ${INSTALL:-0} == 1 ]]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    libvirt-daemon-system libvirt-clients qemu-system-x86 qemu-utils python3-libvirt e2fsprogs
fi

for bin in libvirtd virtlogd qemu-system-x86_64 qemu-img; do
  command -v "$bin" >/dev/null || {
    echo "setup-libvirt.sh: $bin not found: apt-get install libvirt-daemon-system qemu-system-x86 qemu-utils" >&2
    exit 1
  }
done

mkdir -p /run/libvirt /var/log/libvirt/qemu

# /dev/kvm as udev sets it up (root:kvm 0660). Without udev (containers, CI runners) it is often
# root-only: qemu cannot use KVM, and libvirtd then re-probes qemu's capabilities on every
# domain start (tens of seconds each) because its cache never matches.
if [[ -c /dev/kvm ]] && getent group kvm >/dev/null; then
  chgrp kvm /dev/kvm && chmod 0660 /dev/kvm || echo "setup-libvirt.sh: cannot set /dev/kvm to root:kvm 0660" >&2
fi

running() { pgrep -x "$1" >/dev/null 2>&1; }

if running systemd && command -v systemctl >/dev/null && systemctl is-system-running >/dev/null 2>&1; then
  systemctl start virtlogd libvirtd
else
  running virtlogd || virtlogd --daemon
  # --daemon forks once the sockets exist; --timeout 0: never exit when idle.
  running libvirtd || libvirtd --daemon --timeout 0
fi

for _ in $(seq 1 100); do
  if virsh -c qemu:///system version >/dev/null 2>&1; then
    break
  fi
  sleep 0.1
done
if ! virsh -c qemu:///system version >/dev/null 2>&1; then
  echo "setup-libvirt.sh: libvirtd did not answer on qemu:///system (see /var/log/libvirt/)" >&2
  exit 1
fi

if [[ -c /dev/kvm ]] && [[ -r /dev/kvm && -w /dev/kvm ]]; then
  echo "libvirt ready (qemu:///system, KVM available)"
else
  echo "libvirt ready (qemu:///system); /dev/kvm is not usable: VMs will run under TCG (slow)" >&2
fi
