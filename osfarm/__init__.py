"""osfarm: real Linux desktops as async HTTP environments for GUI agents."""

__version__ = "0.1.0"
