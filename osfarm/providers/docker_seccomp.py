"""The seccomp profile of Docker desktops.

Docker's default profile refuses ``unshare``, ``setns`` and ``mount`` to containers without
``CAP_SYS_ADMIN``, and the agent's world needs exactly those, inside the container's own user
namespace (:mod:`osfarm.desktop.box.agent_world`): the guest makes the agent's user namespace, the
agent's root mounts its own /etc and /run there, the guest enters it to start the agent's
processes. The kernel still checks each of them against the caller's capabilities *in its own
namespace*, and the container holds none of ``CAP_SYS_ADMIN`` (its bounding set is SETUID, SETGID,
CHOWN, FOWNER), so they reach nothing of the host's.

So Docker desktops get this profile instead: everything allowed but the system calls no desktop
needs and that widen the kernel's attack surface (the ones Docker's profile also keeps from
unprivileged containers, plus io_uring and the new mount API). A call here fails with EPERM.
"""

from __future__ import annotations

import json

DENIED = {
    "kernel keyrings (not namespaced)": ["add_key", "keyctl", "request_key"],
    "BPF, perf and userfaultfd (frequent kernel exploits)": ["bpf", "perf_event_open", "userfaultfd"],
    "io_uring (frequent kernel exploits)": ["io_uring_setup", "io_uring_enter", "io_uring_register"],
    "file handles (a classic container escape)": ["open_by_handle_at", "name_to_handle_at"],
    "kernel modules and kexec": ["init_module", "finit_module", "delete_module", "create_module",
                                 "kexec_load", "kexec_file_load"],
    "host clocks and power": ["settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime", "reboot"],
    "host resources": ["acct", "swapon", "swapoff", "quotactl", "syslog", "lookup_dcookie", "nfsservctl",
                       "iopl", "ioperm", "vm86", "vm86old", "uselib", "ustat", "sysfs", "_sysctl",
                       "get_kernel_syms", "query_module"],
    "mount API beyond mount/umount (not needed)": ["pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
                                                   "fsmount", "fspick", "mount_setattr"],
}
EPERM = 1


def profile() -> dict:
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [{"names": sorted(n for names in DENIED.values() for n in names), "action": "SCMP_ACT_ERRNO",
                      "errnoRet": EPERM}],
    }


def profile_json() -> str:
    """For docker's ``security_opt=["seccomp=<json>"]``."""
    return json.dumps(profile(), separators=(",", ":"))
