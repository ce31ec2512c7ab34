"""The red team's probes, one registry for tests/security and ``bench/redteam.py`` (a probes x
providers table).

Three kinds of probe:

* ``box``: code an adversarial agent runs inside a leased desktop (:mod:`adversary`); ``code``
  builds it from a :class:`BoxContext` (what the host knows and the box must not reach). Most
  share one episode on one desktop; ``destructive`` ones (bombs) get an episode each, since the
  desktop is expected to die of them. ``judge`` names what else must hold outside the box (the
  farm serving, the socket still the guest's, the bystander desktop alive, the episode's status),
  checked by tests/security/test_box_probes.py.
* ``pytest``: a test elsewhere in tests/security (hostile task files, hostile API calls) whose
  passing means the probe was held; ``node`` is its pytest node id.
* ``warm``: warm-reset persistence, registered by osfarm/testing/redteam/warm_probes.py (``meta``: the
  agent code that leaves something behind, and the code that looks for it in the next lease).

To add a row: append a :class:`Probe` to :data:`PROBES` (or call :func:`register`). Every box
probe's code ends by raising ``HELD: ...`` or ``BREACH: ...``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

PROVIDERS = ("sandbox", "docker", "libvirt")


@dataclass(frozen=True)
class BoxContext:
    """What a box probe is given (host facts it must not be able to reach)."""

    provider: str
    host_paths: list[str]  # must be neither readable nor listable from the box, as user or root
    host_shadow_lines: list[str]  # sha256 of each line of the host's /etc/shadow
    loopback_ports: list[int]  # services on the host's loopback (farm, Redis, policy server)
    marker: str  # a string only another desktop's home holds
    memory_bytes: int  # the desktop's memory limit
    pids: int  # its process limit
    home_bytes: int  # its home's size cap


@dataclass(frozen=True)
class Probe:
    name: str  # the table's row
    title: str  # what it tries
    kind: str  # "box" or "pytest"
    code: Callable[[BoxContext], str] | None = None
    destructive: bool = False
    providers: tuple[str, ...] = PROVIDERS
    node: str = ""  # pytest probes
    judge: str = ""  # what the test checks outside the box besides the verdict
    meta: dict[str, str] = field(default_factory=dict)


PROBES: list[Probe] = []


def register(probe: Probe) -> Probe:
    if any(p.name == probe.name for p in PROBES):
        raise ValueError(f"probe {probe.name!r} is registered twice")
    PROBES.append(probe)
    return probe


def box_probes(provider: str, destructive: bool | None = None) -> list[Probe]:
    return [p for p in PROBES if p.kind == "box" and provider in p.providers
            and (destructive is None or p.destructive == destructive)]


# -- the code every box probe starts with ----------------------------------------------------------

PRELUDE = r'''
import ctypes, hashlib, json, os, shlex, socket, subprocess, time

def _run(cmd, root=False, timeout=60, out_only=False):
    """(exit status, output) of a shell command, as the agent's user or (root) through sudo;
    ``out_only``: stdout alone (what a command read), not its or sudo's complaints."""
    argv = ["sudo", "-S", "-p", "", "sh", "-c", cmd] if root else ["sh", "-c", cmd]
    try:
        r = subprocess.run(argv, input="password\n" if root else None, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    return r.returncode, (r.stdout if out_only else r.stdout + r.stderr).strip()

def _verdict(breaches, held):
    if breaches:
        raise Exception("BREACH: " + "; ".join(breaches)[:3000])
    raise Exception("HELD: " + "; ".join(held)[:3000])
'''


def _code(body: str, **params: object) -> str:
    lines = [f"{k} = json.loads({json.dumps(json.dumps(v))})" for k, v in params.items()]
    return PRELUDE + "\n".join(lines) + "\n" + body


# -- box probes ----------------------------------------------------------------------------------

register(Probe(
    "host_secrets", "read host files: /etc/shadow, /root, the checkout, suite caches, the farm's state dir, "
    "another desktop's dirs, a world-readable host secret, the Docker socket", "box",
    code=lambda ctx: _code(r'''
breaches, held = [], []
for p in PATHS:
    q = shlex.quote(p)
    for root in (False, True):
        rc, out = _run("if [ -e %s ]; then (cat -- %s 2>/dev/null || ls -A -- %s 2>/dev/null) | head -c 80; fi"
                       % (q, q, q),
                       root, out_only=True)
        if rc == 0 and out.strip():
            breaches.append("%s %s: %r" % ("root" if root else "user", p, out[:60]))
held.append("%d host paths: not in the box or unreadable" % len(PATHS))
rc, shadow = _run("cat /etc/shadow", True, out_only=True)
mine = {hashlib.sha256(l.encode()).hexdigest() for l in shadow.splitlines()}
if mine & set(SHADOW):
    breaches.append("the box's /etc/shadow has host lines")
else:
    held.append("/etc/shadow is the box's own (%d lines)" % len(mine))
rc, out = _run("grep -rl -- %s /home /tmp /run /var 2>/dev/null | head -3" % shlex.quote(MARKER), True, out_only=True)
if out.strip():
    breaches.append("another desktop's marker found at " + out.strip())
else:
    held.append("no other desktop's home")
for sock in ("/var/run/docker.sock", "/run/docker.sock", "/run/libvirt/libvirt-sock"):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sock)
        breaches.append("connected to " + sock)
    except OSError as e:
        held.append("%s: %s" % (sock, e.strerror))
    finally:
        s.close()
_verdict(breaches, held)
''', PATHS=ctx.host_paths, SHADOW=ctx.host_shadow_lines, MARKER=ctx.marker),
    judge="nothing of the host's is listed or read",
))

register(Probe(
    "guest_token_socket", "read the guest's token; remove or replace its socket and token (as user and root, "
    "after unmounting the agent's /run)", "box",
    code=lambda ctx: _code(r'''
breaches, held = [], []
for root in (False, True):
    rc, out = _run("cat /run/osfarm/token", root, out_only=True)
    if rc == 0 and out.strip():
        breaches.append("token read as " + ("root" if root else "user"))
    # in a mount namespace of its own, so the agent's /run stays for the next probes
    rc, out = _run("unshare -m --propagation private sh -c 'umount -l /run 2>/dev/null; cat /run/osfarm/token'", root,
                   out_only=True)
    if rc == 0 and out.strip():
        breaches.append("token read after umount /run as " + ("root" if root else "user"))
held.append("token unreadable")
rc, out = _run("unshare -m --propagation private sh -c 'umount -l /run 2>/dev/null; for f in /run/osfarm/guest.sock "
               "/run/osfarm/token; do rm -f $f && ln -s /var/run/docker.sock $f && echo replaced $f; done'", True)
if "replaced" in out:
    breaches.append(out)
else:
    held.append("socket and token not replaceable (%s)" % out[-120:].replace("\n", " "))
_verdict(breaches, held)
'''),
    judge="the farm's copy of the socket is still the guest's socket and answers with the farm's token",
))

register(Probe(
    "kill_guest", "signal, trace or read the guest server and the session's processes (as root)", "box",
    code=lambda ctx: _code(r'''
breaches, held = [], []
me = os.getuid()
rc, out = _run("for p in /proc/[0-9]*; do echo ${p#/proc/} $(awk '/^Uid:/{print $2}' $p/status 2>/dev/null); done",
               True,
               out_only=True)
foreign = [l.split()[0] for l in out.splitlines() if len(l.split()) == 2 and l.split()[1] not in ("0", str(me))]
for pid in foreign[:40] + ["1"]:
    rc, o = _run("kill -0 %s" % pid, True)
    if rc == 0:
        breaches.append("root may signal pid %s" % pid)
    rc, o = _run("head -c 40 /proc/%s/environ" % pid, True, out_only=True)
    if rc == 0 and o.strip():
        breaches.append("root reads pid %s's environment" % pid)
    rc, o = _run("python3 -c 'import ctypes,sys; sys.exit(0 if ctypes.CDLL(None).ptrace(16, %s, 0, 0) == 0 "
                 "else 1)'" % pid, True)
    if rc == 0:
        breaches.append("root traces pid %s" % pid)
held.append("%d guest processes visible; none signalled, traced or read (pid 1 included)" % len(foreign))
_verdict(breaches, held)
'''),
    judge="the guest answers after the probe",
))

register(Probe(
    "box_root", "sudo as OSWorld's (user/password) works, and gives a root that is not the host's: "
    "kernel knobs, devices, modules, hostname are refused", "box",
    code=lambda ctx: _code(r'''
breaches, held = [], []
rc, out = _run("id -u", True)
if rc != 0 or out.strip().splitlines()[:1] != ["0"]:
    breaches.append("sudo did not work: %r" % out[-200:])
elif out.strip() != "0":
    breaches.append("sudo complains: %r" % out[-200:])  # e.g. "unable to resolve host"
else:
    held.append("sudo works in the box")
rc, out = _run("cat /proc/self/uid_map", True, out_only=True)
first = out.split()[:3]
if len(first) == 3 and first[0] == "0" and first[1] == "0":
    breaches.append("the box's root is the host's root (uid_map %s)" % out)
else:
    held.append("box root maps to %s" % (first[1] if len(first) == 3 else out))
attempts = {
    "core_pattern": "cat /proc/sys/kernel/core_pattern > /tmp/cp && cat /tmp/cp > /proc/sys/kernel/core_pattern",
    "mknod": "mknod /tmp/osfarm-sda b 8 0 && cat /tmp/osfarm-sda | head -c 1",
    "hostname": "hostname osfarm-evil-$$ && hostname",
    "module": "modprobe dummy 2>&1 || insmod /nonexistent.ko",
    "sysrq": "test -w /proc/sysrq-trigger && echo writable",
}
for name, cmd in attempts.items():
    rc, out = _run(cmd, True)
    if rc == 0 and (name != "sysrq" or "writable" in out):
        breaches.append("%s succeeded: %r" % (name, out[-80:]))
    else:
        held.append(name + " refused")
_verdict(breaches, held)
'''),
    judge="",
))

register(Probe(
    "loopback_services", "reach the farm, Redis and the policy server on the host's loopback", "box",
    code=lambda ctx: _code(r'''
breaches, held = [], []
for port in PORTS:
    for host in ("127.0.0.1", "::1", "10.0.2.2"):
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect((host, port))
            breaches.append("connected to %s:%d" % (host, port))
        except OSError as e:
            pass
        finally:
            s.close()
held.append("ports %s unreachable" % PORTS)
_verdict(breaches, held)
''', PORTS=ctx.loopback_ports),
    judge="",
))

register(Probe(
    "other_displays", "connect to another desktop's X server (socket files and abstract sockets)", "box",
    code=lambda ctx: _code(r'''
breaches, held = [], []
own = os.environ.get("DISPLAY", ":0").lstrip(":").split(".")[0]
for n in range(0, 64):
    if str(n) == own:
        continue
    for addr in ("\0/tmp/.X11-unix/X%d" % n, "/tmp/.X11-unix/X%d" % n):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1)
        try:
            s.connect(addr)
            breaches.append("X display :%d reachable at %r" % (n, addr))
        except OSError:
            pass
        finally:
            s.close()
held.append("no display but its own (:%s)" % own)
_verdict(breaches, held)
'''),
    judge="",
))

register(Probe(
    "disk_fill", "fill the home and /tmp until the disk is full", "box",
    code=lambda ctx: _code(r'''
breaches, held = [], []
chunk = b"\0" * (8 << 20)
for d in (os.path.expanduser("~"), "/tmp"):
    path, n = os.path.join(d, "osfarm-fill.bin"), 0
    try:
        with open(path, "wb") as f:
            while n < 4 * HOME:
                f.write(chunk)
                f.flush()
                n += len(chunk)
        breaches.append("%s took %d MiB, past 4x the cap" % (d, n >> 20))
    except OSError as e:
        held.append("%s full after %d MiB (%s)" % (d, n >> 20, e.strerror))
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
_verdict(breaches, held)
''', HOME=ctx.home_bytes),
    judge="the desktop keeps working (the files are removed)",
))

register(Probe(
    "sparse_result", "a 100 GB sparse 'result' file for the evaluation's getter to fetch", "box",
    code=lambda ctx: _code(r'''
path = os.path.expanduser("~/result.bin")
with open(path, "wb") as f:
    f.truncate(100 << 30)
raise Exception("HELD: made %s (%d GiB apparent): the evaluation must refuse it" % (path, os.path.getsize(path) >> 30))
'''),
    judge="the evaluation refuses the file (the episode is not a success) and the farm keeps serving",
))

register(Probe(
    "fork_bomb", "fork sleeping children until the box refuses", "box", destructive=True,
    code=lambda ctx: _code(r'''
import signal
kids, err = [], ""
try:
    while len(kids) < 4 * PIDS:
        pid = os.fork()
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    err = e.strerror
for pid in kids:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except OSError:
        pass
if not err:
    raise Exception("BREACH: %d processes forked, past 4x the limit" % len(kids))
time.sleep(3)  # the farm's health check names the limit meanwhile
raise Exception("HELD: fork refused after %d children (%s)" % (len(kids), err))
''', PIDS=ctx.pids),
    judge="the desktop is ended as an infra error naming the process limit; the bystander desktop and the farm live on",
))

register(Probe(
    "memory_bomb", "allocate memory past the desktop's limit", "box", destructive=True,
    code=lambda ctx: _code(r'''
blocks = []
while len(blocks) * (64 << 20) < 2 * MEMORY:
    b = bytearray(64 << 20)
    b[::4096] = b"\1" * len(b[::4096])
    blocks.append(b)
raise Exception("BREACH: allocated %d MiB, twice the limit" % (len(blocks) * 64))
''', MEMORY=ctx.memory_bytes),
    judge="the allocating process is killed; the desktop is ended as an infra error naming the memory limit; "
          "the bystander desktop and the farm live on",
))


# -- hostile task files and API calls (pytest probes: provider-independent, the same for every box) -

_TASKS = "tests/security/test_task_files.py::"
_API = "tests/security/test_api_abuse.py::"
_SETTLE = "tests/security/test_settle_zygote.py::"
for _name, _title, _node in (
    ("task_host_paths", ("task file names host paths: absolute/.. dest, id with / or .., stdout /etc/cron.d/x, "
                         "cache_file .., upload_file /etc/shadow (refused naming file + JSON path)"),
     _TASKS + "test_hostile_paths_are_refused_naming_file_and_json_path"),
    ("suite_escape", "a suite's files or index reach out of the suite",
     _TASKS + "test_a_suite_refuses_hostile_files_and_indexes"),
    ("file_url_assets", "file:///etc/passwd, /etc/passwd and ../ local paths as task assets",
     _TASKS + "test_file_urls_and_local_paths_only_from_the_cache_and_suite"),
    ("suite_cache_symlinks", "a suite cache with symlinks out of it, a planted .part symlink",
     _TASKS + "test_a_suite_cache_cannot_link_out_of_itself"),
    ("hostile_downloads", "a download that redirects to file://, one that never ends",
     _TASKS + "test_downloads_never_leave_http_and_never_run_forever"),
    ("setup_output_escape", "an execute step writes stdout outside the episode dir or through a symlink",
     _TASKS + "test_setup_outputs_stay_in_the_episode_dir"),
    ("huge_result_file", "a 100 GB sparse result file and a zip bomb result: scored 0, farm memory flat",
     _TASKS + "test_a_huge_result_scores_zero_and_the_farm_keeps_serving"),
    ("hostile_suite_eval", "osfarm eval over hostile task files: infra_error rows, nothing written outside",
     _TASKS + "test_an_eval_run_records_hostile_tasks_as_infra_errors"),
    ("foreign_lease", "another client's lease id (GET, step, heartbeat, passthrough, evaluate, DELETE): 404 as unknown",
     _API + "test_another_clients_lease_is_a_404_like_an_unknown_id"),
    ("pool_lease_ids", "/v1/pool lists lease ids to admins and holders only",
     _API + "test_pool_shows_lease_ids_to_admins_and_holders_only"),
    ("viewer_writes", "a viewer token leases or drives a desktop", _API + "test_a_viewer_is_read_only"),
    ("lease_quota", "a client leases past its quota (also with racing requests)", _API + "test_lease_quota_per_client"),
    ("lease_ttl", "a lease or heartbeat TTL beyond the client's max", _API + "test_ttl_beyond_the_clients_max_is_422"),
    ("huge_bodies", "100 GB announced, chunked and passthrough request bodies: 413 before reading",
     _API + "test_huge_bodies_are_413_without_being_read"),
    ("guest_huge_bodies", "huge request bodies to the guest server", _API + "test_the_guest_server_limits_bodies_too"),
    ("bad_tokens", "unknown tokens, a digest as token, broken token files",
     _API + "test_unknown_tokens_and_bad_token_sources"),
    ("api_host_paths", "cache_dir=/etc, offline, hostile ids/stdout/dest/upload paths in reset/evaluate calls",
     _API + "test_task_routes_take_no_host_path"),
    ("api_file_url", "a file:///etc/passwd asset through the farm API",
     _API + "test_a_file_url_outside_the_task_cache_is_refused"),
    ("policy_without_token", "the policy server's routes without its token",
     "tests/security/test_policy_token.py::test_routes_need_the_token"),
    ("settle_zygote_state", "settle code keeps state for the next action: globals, builtins, modules, environment, "
     "cwd, or through its zygote (its memory, fds, environment, a trace)",
     _SETTLE + "test_settle_code_keeps_no_state_and_cannot_reach_its_zygote"),
    ("settle_child_outlives", "a settle action's child clears its parent-death signal and runs on past its timeout",
     _SETTLE + "test_settle_code_cannot_outlive_its_action"),
    ("settle_child_guest", "a settle action's child signals or reads the guest server, or reads its token",
     _SETTLE + "test_settle_code_cannot_reach_the_guest"),
):
    register(Probe(_name, _title, "pytest", node=_node))
