"""OSWorld's ``DesktopEnv`` on osfarm: change one import and OSWorld's runners and agents use a farm's
desktops (``from osfarm.osworld import DesktopEnv``; docs/osworld-compat.md)."""

from osfarm.osworld.desktop_env import DesktopEnv

__all__ = ["DesktopEnv"]
