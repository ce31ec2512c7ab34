"""osfarm's exception hierarchy (osfarm/errors.py): every exception class osfarm defines derives
from OsfarmError, and the runner tells an episode's end apart by the InfraError / EpisodeTimeout
branches with isinstance, never by an attribute looked up by name."""

from __future__ import annotations

import ast
import importlib
import pkgutil

import pytest

import osfarm
from osfarm.agents.chat_client import PolicyBadResponse, PolicyRequestRejected, PolicyUnavailable
from osfarm.errors import EpisodeTimeout, InfraError, OsfarmError
from osfarm.runner.executors.celery_exec import RemoteEpisodeError, RemoteEpisodeTimeout, worker_failure

# Exceptions used as control flow inside one module (never raised to a caller), kept outside the
# hierarchy on purpose, each with its reason.
INTERNAL = {
    "osfarm.desktop.x11.xserver._DisplayBusy": "retry signal inside Xvfb's start loop",
    "osfarm.tasks.setup._StepError": "wrapped into SetupFailed before it leaves the module",
    "osfarm.evaluators.metrics.slides._Mismatch": "early exit inside one comparison",
    "osfarm.desktop.session.a11y_bus.AppGone": "an application left the bus mid-walk; the walk skips it",
    "osfarm.http.body_limit.BodyTooLarge": "turned into a 413 by the middleware that raises it",
    "osfarm.trainer.loop.Aborted": "a rollout the controller aborted; never leaves the trainer",
    "osfarm.desktop.launch.launcher._Stop": "a BaseException the signal handler raises to unwind the launcher's start",
}


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every class in osfarm whose bases name an Exception type, read from the
    source (nothing imported that a missing optional extra would break)."""
    out = []
    for mod in pkgutil.walk_packages(osfarm.__path__, "osfarm."):
        spec = importlib.util.find_spec(mod.name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(open(spec.origin, encoding="utf-8").read())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(_is_exception_base(b) for b in node.bases):
                out.append((mod.name, node.name))
    return out


def _is_exception_base(base: ast.expr) -> bool:
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    return name.endswith(("Error", "Exception", "Timeout", "Unavailable", "Failed", "Missing")) \
        or name in ("Exception", "BaseException", "LookupError", "KeyError")


def test_every_exception_osfarm_defines_is_an_osfarm_error() -> None:
    found = _exception_classes()
    assert len(found) > 40, found  # the scan sees the package
    outside = []
    for module, name in found:
        if f"{module}.{name}" in INTERNAL or module == "osfarm.errors":
            continue
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as e:  # an optional extra missing here: its classes are read elsewhere
            pytest.fail(f"{module} does not import: {e}")
        if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, OsfarmError):
            outside.append(f"{module}.{name}")
    assert not outside, f"exceptions outside OsfarmError (derive them from it, or list them in INTERNAL): {outside}"


def test_infra_and_timeout_are_told_apart_by_class() -> None:
    assert issubclass(PolicyUnavailable, InfraError) and issubclass(PolicyBadResponse, InfraError)
    assert not issubclass(PolicyRequestRejected, InfraError)  # the request's fault: the agent's failure
    assert issubclass(EpisodeTimeout, TimeoutError) and not issubclass(EpisodeTimeout, InfraError)
    e = InfraError("setup step 1 failed", phase="setup")
    assert e.phase == "setup" and str(e) == "setup step 1 failed" and InfraError("x").phase is None


class TimeLimitExceeded(Exception):  # Celery's name for a hard time limit; the class is matched by name
    pass


def test_a_worker_failure_is_infra_unless_celery_timed_it_out() -> None:
    crashed = worker_failure("FAILURE", RuntimeError("segfault in the worker"))
    assert isinstance(crashed, RemoteEpisodeError) and isinstance(crashed, InfraError)
    assert not isinstance(crashed, EpisodeTimeout)
    assert "worker failure: RuntimeError: segfault in the worker" in str(crashed)
    timed_out = worker_failure("FAILURE", TimeLimitExceeded(600))
    assert isinstance(timed_out, RemoteEpisodeTimeout) and isinstance(timed_out, EpisodeTimeout)
    assert not isinstance(timed_out, InfraError)
    revoked = worker_failure("REVOKED", "terminated")
    assert isinstance(revoked, InfraError) and revoked.state == "REVOKED"
