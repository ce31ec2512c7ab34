"""What a setup step's command needs from the network, read from its text (nothing is run).

OSWorld's ``execute``/``command`` steps install packages and fetch files (``sudo -S apt-get
install sysstat``, ``pip install PyMuPDF``, ``wget URL``); OSWorld ignores their exit status, so on
a desktop without network such a step fails silently and the task starts in a state its author
did not intend. :func:`network_needs` says what a command needs:

* ``apt``: packages ``apt``/``apt-get``/``aptitude install`` installs (``=version``,
  ``/release`` dropped; local ``.deb`` files are not needs); ``apt_update``: it runs ``apt update``;
* ``pip``: distributions ``pip install`` (``pip``, ``pip3``, ``pip3.11``, ``python3 -m pip``)
  installs, with the interpreter whose ``pip`` that is; local paths, ``file://`` URLs and
  ``--no-index`` installs are not needs;
* ``fetches``: what no installed package can stand in for: URLs of ``wget``/``curl``, the
  repository of ``git clone``, and whole commands (``snap install``, ``npm install``,
  ``apt-get upgrade``, ``pip install -r FILE``, ``pip download``). Loopback hosts and local
  paths are not fetches;
* ``offline``: the command with every network part replaced by ``true`` (what runs on a desktop
  that already has the packages), or None where a network part cannot be cut out alone (inside a
  nested ``bash -c`` of a shell string, or an install that mixes local files with packages).

A shell string is cut into simple commands at unquoted ``&&``, ``||``, ``;``, ``|``, ``&``,
newlines, parentheses and backquotes (so ``$(curl URL)`` is seen), comments dropped; each simple
command is split with :mod:`shlex`. ``VAR=value`` prefixes, ``sudo``/``env``/``nohup``/``nice``/
``timeout``/``time``/``exec``/``command`` and their options are seen through, and ``bash -c
SCRIPT`` (``sh``, ``dash``, ``zsh``) is read recursively. Not seen: scripts run from files,
``eval``, ``$(...)`` inside double quotes, URLs without a scheme (``curl example.com``: telling
them from file names would need every option of curl and wget), ``git pull``/``fetch`` (whether
the remote is local is in the repository, not in the command).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from enum import Enum
from urllib.parse import urlsplit

Command = str | list[str]

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "0.0.0.0", "::1", "ip6-localhost"})


@dataclass(frozen=True)
class PipPackage:
    name: str  # the distribution as written (``PyMuPDF``), extras and version dropped
    python: str  # the interpreter whose pip installs it (``python3`` for ``pip``)


@dataclass(frozen=True)
class NetworkNeeds:
    apt: tuple[str, ...] = ()
    apt_update: bool = False
    pip: tuple[PipPackage, ...] = ()
    fetches: tuple[str, ...] = ()
    parts: tuple[str, ...] = ()  # the simple commands that use the network, as written
    offline: Command | None = None

    def __bool__(self) -> bool:
        """True when the command uses the network at all."""
        return bool(self.parts)


class _Use(Enum):
    LOCAL = "local"  # needs no network
    NETWORK = "network"  # a network part: cut out as a whole on an offline desktop
    MIXED = "mixed"  # needs the network, and also does local work: it cannot be cut out


@dataclass
class _Found:
    apt: list[str] = field(default_factory=list)
    apt_update: bool = False
    pip: list[PipPackage] = field(default_factory=list)
    fetches: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)


def network_needs(command: Command, shell: bool = False) -> NetworkNeeds:
    """What ``command`` (as an ``execute`` step's ``command``/``shell``) needs from the network."""
    found = _Found()
    offline: Command | None
    if not isinstance(command, (str, list)):
        return NetworkNeeds(offline=command)  # not a command: the guest refuses it, naming the field
    if isinstance(command, str) and shell:
        offline, _ = _script(command, found)
    elif isinstance(command, list) and shell:
        # subprocess runs a list with shell=True as the script command[0] (the rest are $0, $1...)
        script, _ = _script(command[0], found) if command else ("", False)
        offline = None if script is None else [script, *command[1:]]
    else:
        argv = _split(command) if isinstance(command, str) else [str(w) for w in command]
        offline = _argv(argv, found)
    if not found.parts:
        offline = command  # untouched, as the task wrote it
    return NetworkNeeds(tuple(dict.fromkeys(found.apt)), found.apt_update, tuple(dict.fromkeys(found.pip)),
                        tuple(dict.fromkeys(found.fetches)), tuple(found.parts), offline)


# ---------------------------------------------------------------------------- shell text


def _script(script: str, found: _Found) -> tuple[str | None, bool]:
    """The script with its network parts replaced by ``true`` (None: one cannot be cut out), and
    whether every simple command of it was a network part."""
    out, last, all_network, any_part, cuttable = [], 0, True, False, True
    for start, end in _spans(script):
        text = script[start:end]
        words = _words(text)
        if not words:
            continue
        any_part = True
        use, _ = _simple(words, found, text.strip())
        if use is _Use.LOCAL:
            all_network = False
        elif use is _Use.MIXED:  # read on all the same: the rest's needs go into `found` too
            all_network = cuttable = False
        else:
            lead = len(text) - len(text.lstrip())
            out.append(script[last:start + lead] + "true")
            last = start + len(text.rstrip())
    out.append(script[last:])
    return ("".join(out) if cuttable else None), all_network and any_part


def _spans(script: str) -> list[tuple[int, int]]:
    """(start, end) of each simple command: the text between unquoted separators, comments out."""
    spans: list[tuple[int, int]] = []
    start, i, n, word_start = 0, 0, len(script), True
    while i < n:
        ch = script[i]
        if ch == "\\":
            i, word_start = i + 2, False
        elif ch == "'":
            j = script.find("'", i + 1)
            i, word_start = (n if j < 0 else j + 1), False
        elif ch == '"':
            i, word_start = _after_double_quote(script, i), False
        elif ch == "#" and word_start:
            spans.append((start, i))
            j = script.find("\n", i)
            i = start = n if j < 0 else j
        elif size := _separator(script, i):
            spans.append((start, i))
            i = start = i + size
            word_start = True
        else:
            i, word_start = i + 1, ch.isspace()
    spans.append((start, n))
    return [(a, b) for a, b in spans if script[a:b].strip()]


def _after_double_quote(s: str, i: int) -> int:
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return len(s)


def _separator(s: str, i: int) -> int:
    """Length of the command separator at ``s[i]``, 0 if none (``2>&1``, ``&>``, ``>|`` are
    redirections, not separators)."""
    two = s[i:i + 2]
    if two in ("&&", "||", "|&", ";;"):
        return 2
    ch, prev = s[i], s[i - 1] if i else ""
    if ch in ";\n()`":
        return 1
    if ch == "|":
        return 0 if prev == ">" else 1
    if ch == "&":
        return 0 if prev in "<>" or two == "&>" else 1
    return 0


_REDIRECT = re.compile(r"(?:\d+|&)?(?:>>|>&|>\||<<<|<<|<&|<>|>|<)(.*)", re.S)


def _words(text: str) -> list[str]:
    """The words of one simple command, redirections (``2>/dev/null``, ``> out``) dropped."""
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote: the shell would refuse it too; read what is there
        words = text.split()
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        m = _REDIRECT.fullmatch(w)
        if m:
            skip = not m.group(1)  # "> file": the target is the next word
            continue
        out.append(w)
    return out


def _split(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


# ---------------------------------------------------------------------------- one simple command


def _argv(argv: list[str], found: _Found) -> list[str] | None:
    """An argv run without a shell, with its network part cut out (None: it cannot be)."""
    use, nested = _simple(argv, found, shlex.join(argv))
    if use is _Use.NETWORK:
        return ["true"]
    if use is _Use.MIXED:
        if nested is None:
            return None
        index, script = nested
        return None if script is None else [*argv[:index], script, *argv[index + 1:]]
    return argv


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)
# wrapper -> (its options that take a value, positional words before the command)
_WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "sudo": (frozenset({"-u", "-g", "-p", "-C", "-D", "-h", "-r", "-t", "-U", "-T", "-R", "--user", "--group",
                        "--prompt", "--close-from", "--chdir", "--host", "--role", "--type", "--other-user",
                        "--command-timeout", "--chroot"}), 0),
    "env": (frozenset({"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}), 0),
    "nice": (frozenset({"-n", "--adjustment"}), 0),
    "timeout": (frozenset({"-s", "--signal", "-k", "--kill-after"}), 1),
    "nohup": (frozenset(), 0),
    "time": (frozenset({"-f", "--format", "-o", "--output"}), 0),
    "exec": (frozenset({"-a"}), 0),
    "command": (frozenset(), 0),
}
_SHELLS = frozenset({"sh", "bash", "dash", "zsh"})


def _unwrap(words: list[str]) -> int:
    """Index of the command that runs: past ``VAR=value``, ``sudo -S``, ``env -i`` & co."""
    i = 0
    while i < len(words):
        if _ASSIGNMENT.fullmatch(words[i]):
            i += 1
            continue
        spec = _WRAPPERS.get(os.path.basename(words[i]))
        if spec is None:
            return i
        takes_value, positionals = spec
        i += 1
        while i < len(words) and words[i].startswith("-") and words[i] != "-":
            option = words[i]
            i += 2 if option in takes_value else 1
            if option == "--":
                break
        i += positionals
    return i


_PIP = re.compile(r"pip(\d+(\.\d+)?)?")
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")

_Nested = tuple[int, str | None]


def _simple(words: list[str], found: _Found, text: str) -> tuple[_Use, _Nested | None]:
    """How one simple command uses the network; what it needs goes into ``found``. A nested
    shell comes back with (index of its script word, the script rewritten or None)."""
    k = _unwrap(words)
    if k >= len(words):
        return _Use.LOCAL, None
    prog, args = os.path.basename(words[k]), words[k + 1:]
    if prog in _SHELLS:
        return _nested_shell(words, k, found)
    use = _program(prog, words[k], args, found)
    if use is not _Use.LOCAL:
        found.parts.append(text)
    return use, None


def _program(prog: str, path: str, args: list[str], found: _Found) -> _Use:
    if prog in ("apt", "apt-get", "aptitude"):
        return _apt(prog, args, found)
    if _PIP.fullmatch(prog):
        return _pip(args, _python_of_pip(path), found)
    if _PYTHON.fullmatch(prog) and args[:2] == ["-m", "pip"]:
        return _pip(args[2:], path, found)
    if prog in ("wget", "curl"):
        return _download(prog, args, found)
    if prog == "git":
        return _git(args, found)
    if prog == "snap" and args[:1] and args[0] in ("install", "refresh", "download"):
        found.fetches.append(shlex.join(["snap", *args]))
        return _Use.NETWORK
    if prog == "npm" and args[:1] and args[0] in ("install", "i", "ci", "add", "update", "exec"):
        found.fetches.append(shlex.join(["npm", *args]))
        return _Use.NETWORK
    if prog == "code":
        return _code(args, found)
    return _Use.LOCAL


def _code(args: list[str], found: _Found) -> _Use:
    """``code --install-extension ID``: an extension by id comes from the marketplace (Open VSX for
    the desktop's code-server); a ``.vsix`` path installs from the disk."""
    ids, local = [], False
    for i, a in enumerate(args):
        value = args[i + 1] if a == "--install-extension" and i + 1 < len(args) else \
            a.partition("=")[2] if a.startswith("--install-extension=") else None
        if value is None:
            continue
        if value.endswith(".vsix"):
            local = True
        else:
            ids.append(value)
    if not ids:
        return _Use.LOCAL
    found.fetches.extend(f"the VS Code extension {x} (marketplace)" for x in ids)
    return _Use.MIXED if local else _Use.NETWORK


def _nested_shell(words: list[str], k: int, found: _Found) -> tuple[_Use, _Nested | None]:
    """``bash -c SCRIPT``: SCRIPT is read like a shell string; a script file is not opened."""
    has_c, i = False, k + 1
    while i < len(words) and words[i][:1] in ("-", "+") and words[i] not in ("-", "--"):
        if words[i] in ("-o", "+o", "-O", "+O"):
            i += 1
        elif not words[i].startswith("--") and "c" in words[i][1:]:
            has_c = True
        i += 1
    if not has_c or i >= len(words):
        return _Use.LOCAL, None
    parts = len(found.parts)
    script, all_network = _script(words[i], found)
    if len(found.parts) == parts:
        return _Use.LOCAL, None
    return (_Use.NETWORK if all_network else _Use.MIXED), (i, script)


def _positionals(args: list[str], takes_value: frozenset[str]) -> tuple[list[str], list[str]]:
    """(options, positional words): options with a separate value take the next word along."""
    options, positional, i = [], [], 0
    while i < len(args):
        a = args[i]
        if a == "--":
            positional.extend(args[i + 1:])
            break
        if a.startswith("-") and a != "-":
            options.append(a)
            if a in takes_value and i + 1 < len(args):
                options.append(args[i + 1])
                i += 1
        else:
            positional.append(a)
        i += 1
    return options, positional


# ---------------------------------------------------------------------------- package managers

_APT_VALUE = frozenset({"-o", "-c", "-t", "-a", "--option", "--config-file", "--target-release", "--default-release",
                        "--host-architecture"})
_APT_FETCH = frozenset({"upgrade", "full-upgrade", "dist-upgrade", "build-dep", "source", "download", "changelog",
                        "safe-upgrade"})


def _apt(prog: str, args: list[str], found: _Found) -> _Use:
    _, positional = _positionals(args, _APT_VALUE)
    if not positional:
        return _Use.LOCAL
    sub, rest = positional[0], positional[1:]
    if sub == "update":
        found.apt_update = True
        return _Use.NETWORK
    if sub in _APT_FETCH:
        found.fetches.append(f"{prog} {sub}")
        return _Use.NETWORK
    if sub not in ("install", "reinstall"):
        return _Use.LOCAL  # remove, purge, list, show, policy...: the desktop's own database
    local = [p for p in rest if p.startswith(("/", "./", "../", "~")) or p.endswith(".deb")]
    names = [re.split(r"[=/]", p, maxsplit=1)[0] for p in rest if p not in local]
    if not rest:  # `apt-get install -f`: fixes dependencies from the archive
        found.fetches.append(f"{prog} {sub} (no packages named)")
        return _Use.NETWORK
    found.apt.extend(names)
    if not names:
        return _Use.LOCAL
    return _Use.MIXED if local else _Use.NETWORK


_PIP_VALUE = frozenset({"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url",
                        "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--platform",
                        "--python-version", "--implementation", "--abi", "--src", "--upgrade-strategy",
                        "--global-option", "-C", "--config-settings", "--no-binary", "--only-binary", "--log",
                        "--cache-dir", "--proxy", "--retries", "--timeout", "--exists-action", "--trusted-host",
                        "--cert", "--client-cert", "--report", "--python", "--progress-bar", "--root-user-action"})
_REQUIREMENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([<>=!~;@].*)?", re.S)
_LOCAL_FILE = re.compile(r"[./~].*|.*\.(whl|tar\.gz|tgz|tar\.bz2|zip)", re.S)


def _python_of_pip(path: str) -> str:
    """``pip``/``pip3`` -> ``python3``, ``pip3.11`` -> ``python3.11``; a pip named by path is
    the one next to its interpreter (a virtual environment's ``bin/``)."""
    version = os.path.basename(path)[len("pip"):] or "3"
    python = f"python{version}"
    return os.path.join(os.path.dirname(path), python) if os.path.dirname(path) else python


def _pip(args: list[str], python: str, found: _Found) -> _Use:
    options, positional = _positionals(args, _PIP_VALUE)
    if not positional:
        return _Use.LOCAL
    sub, reqs = positional[0], positional[1:]
    if sub in ("download", "wheel"):
        found.fetches.append(f"pip {sub} {' '.join(reqs)}".strip())
        return _Use.NETWORK
    if sub != "install" or "--no-index" in options:
        return _Use.LOCAL  # uninstall, show, list...; --no-index: only local --find-links
    fetches, names, local = [], [], False
    for i, opt in enumerate(options):
        value = options[i + 1] if i + 1 < len(options) else ""
        if opt in ("-r", "--requirement"):
            fetches.append(f"pip install -r {value}")
        elif opt in ("-e", "--editable") and ("://" in value or value.startswith("git+")):
            fetches.append(value)
        elif opt in ("-e", "--editable"):
            local = True
    for r in reqs:
        if "://" in r:
            local, fetches = (True, fetches) if r.startswith("file:") else (local, [*fetches, r])
        elif _LOCAL_FILE.fullmatch(r):
            local = True
        elif m := _REQUIREMENT.fullmatch(r):
            names.append(m.group(1))
        else:
            fetches.append(f"pip install {r}")
    if not (fetches or names):
        return _Use.LOCAL
    found.fetches.extend(fetches)
    found.pip.extend(PipPackage(n, python) for n in names)
    return _Use.MIXED if local else _Use.NETWORK


# ---------------------------------------------------------------------------- downloads

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


def remote_url(url: str) -> bool:
    """A URL on another machine: not ``file://``, not a loopback host."""
    parts = urlsplit(url)
    if parts.scheme.lower() == "file":
        return False
    return (parts.hostname or "").lower() not in LOCAL_HOSTS and not (parts.hostname or "").startswith("127.")


def _download(prog: str, args: list[str], found: _Found) -> _Use:
    urls = [a for a in args if _URL.fullmatch(a)]
    remote = [u for u in urls if remote_url(u)]
    found.fetches.extend(f"{u} ({prog})" for u in remote)
    return _Use.NETWORK if remote else _Use.LOCAL


_GIT_VALUE = frozenset({"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--exec-path"})
_CLONE_VALUE = frozenset({"-b", "--branch", "-o", "--origin", "--depth", "-c", "--config", "--reference",
                          "--reference-if-able", "-u", "--upload-pack", "--template", "--separate-git-dir", "-j",
                          "--jobs", "--filter", "--shallow-since", "--shallow-exclude", "--server-option",
                          "--bundle-uri"})
_SCP_LIKE = re.compile(r"(?:[^@/:\s]+@)?([^/:\s]+):(?!//).*", re.S)


def _git(args: list[str], found: _Found) -> _Use:
    _, positional = _positionals(args, _GIT_VALUE)
    if positional[:1] != ["clone"]:
        return _Use.LOCAL
    i = args.index("clone")
    _, rest = _positionals(args[i + 1:], _CLONE_VALUE)
    if not rest:
        return _Use.LOCAL
    repo = rest[0]
    scp = _SCP_LIKE.fullmatch(repo)
    remote = (remote_url(repo) if "://" in repo else
              scp is not None and scp.group(1).lower() not in LOCAL_HOSTS and not repo.startswith(("/", ".", "~")))
    if not remote:
        return _Use.LOCAL
    found.fetches.append(f"{repo} (git clone)")
    return _Use.NETWORK


__all__ = ["LOCAL_HOSTS", "Command", "NetworkNeeds", "PipPackage", "network_needs", "remote_url"]
