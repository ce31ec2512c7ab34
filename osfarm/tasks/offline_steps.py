"""A setup command that needs the network, on a desktop that has none: run what can run, or fail.

The farm's desktops have no network (and a sandbox desktop's ``/usr`` and dpkg database are
read-only, so nothing installs at setup time anyway). OSWorld ignores an ``execute`` step's exit
status, so a ``sudo -S apt-get install sysstat`` that fails there leaves the task in a state its
author did not intend: unsolvable, or already solved. :func:`offline_command` decides before the
step runs, from :func:`osfarm.tasks.network_steps.network_needs`:

* a URL, repository or other fetch no installed package can stand in for: :class:`NeedsNetwork`;
* packages it installs are looked up on the desktop (apt: ``dpkg-query -W -f '${Status}'``; pip:
  ``importlib.metadata.distribution(NAME)`` in the interpreter that pip belongs to, which matches
  the distribution name as pip does, so ``PyMuPDF`` is found although it imports as ``fitz``).
  One missing: :class:`NeedsNetwork` naming it;
* all there: the command runs with its network parts replaced by ``true``. Running it as written
  would not do: ``apt-get update`` and ``apt-get install`` fail offline (and on a read-only dpkg
  database), and in ``apt-get install unzip -y && unzip x.zip`` that failure would skip the
  ``unzip`` the task needs. ``apt update`` alone needs nothing: package lists matter only to the
  installs after it, which are checked. Versions (``pkg==1.2``, ``--upgrade``) are not compared:
  an installed package stands in for the one the step would fetch.

The setup executor turns :class:`NeedsNetwork` into :class:`~osfarm.tasks.setup.SetupFailed`, so
the episode is an ``infra_error`` naming the step, as a download missing from the cache is.
"""

from __future__ import annotations

from osfarm.errors import OsfarmError
from osfarm.tasks.controller import GuestController
from osfarm.tasks.network_steps import Command, NetworkNeeds, PipPackage, network_needs

CHECK_TIMEOUT_S = 30.0
# exits 0 when the distribution is installed; importlib.metadata normalises the name as pip does
_HAS_DISTRIBUTION = "import importlib.metadata as m, sys; m.distribution(sys.argv[1])"


class NeedsNetwork(OsfarmError):
    """The step needs something from the network that the desktop does not have."""


def offline_command(controller: GuestController, command: Command, shell: bool) -> tuple[Command, NetworkNeeds]:
    """The command to run in place of ``command`` on an offline desktop, and what it needed
    (falsy when nothing: then the command comes back as it is). Raises NeedsNetwork."""
    needs = network_needs(command, shell)
    if not needs:
        return command, needs
    if needs.fetches:
        raise NeedsNetwork(f"needs the network: {_quote(needs.parts)} fetches {', '.join(needs.fetches)}, "
                           "and this farm is offline")
    missing = [f"apt package {name!r}" for name in needs.apt if not apt_installed(controller, name)]
    missing += [f"pip package {p.name!r}" for p in needs.pip if not pip_installed(controller, p)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise NeedsNetwork(f"needs the network: {' and '.join(missing)} {verb} not installed and this farm is "
                           f"offline ({_quote(needs.parts)})")
    if needs.offline is None:
        raise NeedsNetwork(f"needs the network: {_quote(needs.parts)} cannot be left out on its own (it sits in "
                           "a nested shell or installs local files too), and this farm is offline")
    return needs.offline, needs


def apt_installed(controller: GuestController, name: str) -> bool:
    """dpkg's status ends in ``installed`` (``install ok installed``; ``deinstall ok config-files``
    and unknown packages are not)."""
    r = controller.execute(["env", "dpkg-query", "-W", "-f", "${Status}", name], timeout=CHECK_TIMEOUT_S)
    words = (r.get("output") or "").split()
    return r.get("returncode") == 0 and words[-1:] == ["installed"]


def pip_installed(controller: GuestController, package: PipPackage) -> bool:
    # through `env`, so an interpreter the desktop lacks is a missing package (exit 127), not a
    # guest error
    r = controller.execute(["env", package.python, "-c", _HAS_DISTRIBUTION, package.name], timeout=CHECK_TIMEOUT_S)
    return r.get("returncode") == 0


def _quote(parts: tuple[str, ...]) -> str:
    return ", ".join(f"`{p}`" for p in parts)


__all__ = ["NeedsNetwork", "apt_installed", "offline_command", "pip_installed"]
