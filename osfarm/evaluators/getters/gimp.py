"""GIMP getters (OSWorld ``getters/gimp.py``): GIMP's config files from the user's profile."""

from __future__ import annotations

from typing import Any

from osfarm.evaluators.getters.env import HOME, EvalEnv


def get_gimp_config_file(env: EvalEnv, config: dict[str, Any]) -> str | None:
    """GIMP's config file ``file_name`` (``~/.config/GIMP/2.10/``, else ``3.0/``) saved as
    ``dest``; None when missing."""
    for version in ("2.10", "3.0"):
        data = env.controller.get_file(f"{HOME}/.config/GIMP/{version}/{config['file_name']}")
        if data is not None:
            return env.save(config["dest"], data)
    return None
