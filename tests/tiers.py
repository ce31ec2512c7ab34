"""Test tiers: every test is in exactly one of ``unit``, ``desktop`` and ``acceptance``.

- ``acceptance``: the end-to-end runs (a suite replayed on real desktops, the OSWorld tasks,
  ``osfarm train`` end to end, the red team, chaos). Marked by hand where they are written.
- ``desktop``: a test that starts something real: a desktop (a sandbox, docker or libvirt box, the
  session launcher, Xvfb), a farm or a farm process, docker, Redis or Celery workers, the policy
  server, a browser, or a model (the tiny policy model trained, EasyOCR's reader). Found by the
  rule below; ``@pytest.mark.desktop`` where the rule cannot see it.
- ``unit``: everything else. ``make test-fast`` runs this tier alone (``pytest -m unit``: the others
  are deselected, none skipped). While a unit test runs, starting a process or box the rule looks
  for fails it (the guard below), so a miss of the rule shows up as a failure that names what was
  started, not as a slower fast tier.

The rule reads code, not test names: a test is ``desktop`` when its body, the fixtures it uses
(their whole closure: conftest's ``farm`` too) and the functions and classes of tests/ these
reach name one of ``STARTERS`` (the shared helpers of ``osfarm.testing`` count by their names
there: ``running_farm`` starts a farm, unless the code hands it a ``MemoryProvider``, whose farm
has no desktop and no process), hold one of ``STARTED`` as a constant (a program in an argv, a
``python -m`` module), or run osfarm's command line with a subcommand of ``CLI_STARTS`` or
``eval``. A tier marker on the test, its class or its module wins over the rule; a ``slow`` test
(real apps) is never ``unit``. ``pytest --collect-only -q --tiers`` prints every test's tier and why.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FunctionType, MethodType, ModuleType
from typing import Any

import pytest

TIERS = ("unit", "desktop", "acceptance")
TESTS = Path(__file__).resolve().parent

# Names whose use starts something real: osfarm's providers, local farm and policy process,
# docker's client, a browser, and the helpers (osfarm.testing's, tests/') that start a farm, a farm
# process, Redis, the policy server, docker images, containers or the red team's farm.
STARTERS = frozenset({
    "SandboxProvider", "DockerProvider", "LibvirtProvider", "BoxTemplate", "local_farm", "PolicyProcess",
    "docker_client", "sync_playwright", "async_playwright",
    "running_farm", "sandbox_guest", "FarmProcess", "RedisServer", "policy_server", "ensure_images",
    "docker_or_skip", "redteam_farm", "run_warm_probes", "provider_options", "containers",
    # models: the trainer's Learner loads and trains the tiny policy model; OCR builds EasyOCR's reader
    "Learner", "image_texts", "compare_image_text",
})
# Programs and ``python -m`` modules that are a desktop or a service when a test starts them.
PROGRAMS = frozenset({
    "Xvfb", "Xorg", "Xephyr", "Xvnc", "openbox", "gnome-shell", "unshare", "docker", "dockerd", "virsh",
    "virt-install", "redis-server", "celery", "chromium", "chromium-browser", "google-chrome", "soffice",
    "libreoffice", "code-server",
})
MODULES = frozenset({"osfarm.desktop.launch.launcher", "osfarm.desktop.box.box_init",
                     "osfarm.desktop.launch.box_zygote",
                     "torch.distributed.run"})
STARTED = PROGRAMS | MODULES
# ``osfarm`` subcommands that start a farm, a desktop, workers, the policy server or a trainer
# (``eval`` without ``--url`` starts a farm of its own).
CLI_STARTS = frozenset({"serve", "desktop", "worker", "policy", "demo", "train"})


# -- the rule -------------------------------------------------------------------------------------


def _codes(code: CodeType) -> Iterator[CodeType]:
    yield code
    for c in code.co_consts:
        if isinstance(c, CodeType):
            yield from _codes(c)


def _strings(consts: tuple[Any, ...]) -> Iterator[str]:
    for c in consts:
        if isinstance(c, str):
            yield c
        elif isinstance(c, tuple | frozenset):
            yield from _strings(tuple(c))


def _ours(obj: Any) -> bool:
    """Code of the test suite (its modules and helpers), which the rule follows into."""
    try:
        f = inspect.getsourcefile(obj)
    except TypeError:
        return False
    return f is not None and Path(f).resolve().is_relative_to(TESTS)


@dataclass
class Facts:
    """What a piece of test code and everything of tests/ it reaches names: globals and attributes,
    string constants, and whether it runs osfarm's command line."""

    names: set[str] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)
    cli: bool = False

    def add(self, other: Facts) -> None:
        self.names |= other.names
        self.strings |= other.strings
        self.cli |= other.cli

    def why(self) -> str | None:
        hit = self.names & STARTERS
        if "MemoryProvider" in self.names:
            hit -= {"running_farm"}  # running_farm(provider=MemoryProvider()): boxes in this process
        if hit:
            return f"uses {sorted(hit)[0]}"
        if hit := self.strings & STARTED:
            return f"starts {sorted(hit)[0]}"
        if self.cli and (hit := self.strings & CLI_STARTS):
            return f"runs osfarm {sorted(hit)[0]}"
        if "eval_command" in self.names or self.cli and self.strings & {"eval", "eval-command"}:
            return "runs osfarm eval"  # on a farm of its own, or on one the test started
        return None


def _runs_cli(value: Any) -> bool:
    """osfarm's command line: its typer app, ``-m osfarm.cli`` / ``from osfarm.cli import app``,
    or the ``osfarm`` executable."""
    if isinstance(value, str):
        return "osfarm.cli" in value or value == "osfarm" or value.endswith("/osfarm")
    if isinstance(value, list | tuple):
        return any(_runs_cli(v) for v in value)
    return type(value).__module__.startswith("typer") and type(value).__name__ == "Typer"


class Rule:
    """The facts of test code (memoised), which ``Facts.why`` judges."""

    def __init__(self) -> None:
        self._seen: dict[int, Facts] = {}

    def facts(self, obj: Any) -> Facts:
        obj = inspect.unwrap(obj) if callable(obj) else obj
        if isinstance(obj, MethodType):
            obj = obj.__func__
        key = id(obj)
        if key not in self._seen:
            self._seen[key] = f = Facts()  # a cycle adds nothing more
            self._collect(obj, f)
        return self._seen[key]

    def _collect(self, obj: Any, f: Facts) -> None:
        if isinstance(obj, type):
            if _ours(obj):
                for v in vars(obj).values():
                    v = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
                    if isinstance(v, FunctionType):
                        f.add(self.facts(v))
            return
        if not isinstance(obj, FunctionType) or not _ours(obj):
            return
        names: set[str] = set()
        for code in _codes(obj.__code__):
            names.update(code.co_names)
            f.strings.update(_strings(code.co_consts))
        f.names |= names
        f.cli |= any(_runs_cli(s) for s in f.strings)
        follow = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
        g = obj.__globals__
        for n in sorted(names):
            v = g.get(n)
            if isinstance(v, ModuleType):
                if _ours(v):
                    follow += [getattr(v, m) for m in sorted(names) if hasattr(v, m)]
            elif isinstance(v, type | FunctionType | MethodType):
                follow.append(v)
            elif v is not None and _runs_cli(v):
                f.cli = True
        for v in follow:
            if v is not obj and isinstance(v, type | FunctionType | MethodType):
                f.add(self.facts(v))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def tier_of(item: pytest.Item, rule: Rule) -> tuple[str, str]:
    """The item's tier and why."""
    marked = [t for t in TIERS if item.get_closest_marker(t)]
    for t in ("acceptance", "desktop", "unit"):
        if t in marked:
            return t, "marked"
    if item.get_closest_marker("slow"):
        return "desktop", "marked slow"
    facts = Facts()
    fn = getattr(item, "function", None)
    if fn is not None:
        facts.add(rule.facts(fn))
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs if info else {}).values():
        for d in defs:
            facts.add(rule.facts(d.func))
    if why := facts.why():
        return "desktop", why
    return "unit", ""


# -- the guard ------------------------------------------------------------------------------------


class StartedInUnitTest(Exception):
    pass


_unit_item: pytest.Item | None = None


def _forbidden(args: Any) -> str | None:
    argv = [os.fsdecode(a) for a in ([args] if isinstance(args, str | bytes | os.PathLike) else args)]
    if not argv:
        return None
    prog = os.path.basename(argv[0].split()[0]) if argv[0] else ""
    if prog in PROGRAMS or prog.startswith("qemu-system"):
        return prog
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] in MODULES:
        return f"python -m {argv[argv.index('-m') + 1]}"
    osfarm_at = next((i for i, a in enumerate(argv) if os.path.basename(a) == "osfarm" or a == "osfarm.cli"), None)
    if osfarm_at is not None:
        sub = [a for a in argv[osfarm_at + 1:] if not a.startswith("-")][:1]
        if sub and (sub[0] in CLI_STARTS or (sub[0] == "eval" and "--url" not in argv)):
            return f"osfarm {sub[0]}"
    return None


def _install_guard() -> None:
    """Wrap what starts processes and boxes; the wrappers refuse while a unit test runs."""
    real_child: Callable[..., Any] = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> Any:
        if _unit_item is not None and (what := _forbidden(args)):
            raise StartedInUnitTest(f"{_unit_item.nodeid} is in the unit tier but starts {what}: "
                                    "mark it @pytest.mark.desktop (see tests/tiers.py)")
        return real_child(self, args, *rest, **kw)

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]

    for mod, cls in (("osfarm.providers.sandbox", "SandboxProvider"), ("osfarm.providers.docker", "DockerProvider"),
                     ("osfarm.providers.libvirt", "LibvirtProvider")):
        try:
            klass = getattr(__import__(mod, fromlist=[cls]), cls)
        except ImportError:
            continue
        _guard_start(klass)


def _guard_start(klass: type) -> None:
    real = klass.start

    async def start(self: Any, *a: Any, **kw: Any) -> Any:
        if _unit_item is not None:
            raise StartedInUnitTest(f"{_unit_item.nodeid} is in the unit tier but starts a {klass.__name__} "
                                    "desktop: mark it @pytest.mark.desktop (see tests/tiers.py)")
        return await real(self, *a, **kw)

    klass.start = start


@contextlib.contextmanager
def guarding(item: pytest.Item) -> Iterator[None]:
    global _unit_item
    _unit_item = item if item.get_closest_marker("unit") else None
    try:
        yield
    finally:
        _unit_item = None


# -- the hooks (tests/conftest.py registers this module as a plugin) -------------------------------


def pytest_configure(config: pytest.Config) -> None:
    _install_guard()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every collected test in its tier (before ``-m`` deselects by it)."""
    rule = Rule()
    for item in items:
        tier, why = tier_of(item, rule)
        item.user_properties.append(("tier", tier))
        if why:
            item.user_properties.append(("tier_why", why))
        if not item.get_closest_marker(tier):
            item.add_marker(tier)
    if config.getoption("--tiers", default=False):
        for item in items:
            props = dict(item.user_properties)
            print(f"{props['tier']:<10} {item.nodeid}  {props.get('tier_why', '')}", file=sys.stderr)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tiers", action="store_true", help="print every test's tier and why (with --collect-only)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with guarding(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with guarding(item):
        return (yield)
