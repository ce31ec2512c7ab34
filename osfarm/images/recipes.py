"""What each desktop image is made of: names, build contexts and recipe hashes.

A recipe hash (label ``org.osfarm.recipe``) is the sha256 of every file that goes into an
image's build context (path, mode, content) plus the recipe of its parent images. An image whose
label matches the hash computed from the checkout is up to date and is not rebuilt, so test
runs and CI build each image once.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import osfarm
from osfarm.errors import OsfarmError

VERSION = osfarm.__version__
BASE_REPO = "osfarm/base"
BASE_TAG = "bookworm"
BASE_IMAGE = f"{BASE_REPO}:{BASE_TAG}"
RUNTIME_REPO = "osfarm/runtime"
DESKTOP_REPO = "osfarm/desktop"
LABEL_VERSION = "org.osfarm.version"
LABEL_RECIPE = "org.osfarm.recipe"
LABEL_KIND = "org.osfarm.image"
IMAGES = ("base", "runtime", "desktop")
# Debian release and debootstrap settings of the base image (part of its recipe).
SUITE = "bookworm"
VARIANT = "minbase"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache"}
SKIP_SUFFIXES = (".pyc", ".pyo")


class RecipeError(OsfarmError, RuntimeError):
    """The image recipe files cannot be found; the message says where they were looked for."""


def image_ref(kind: str, tag: str | None = None) -> str:
    """``osfarm/runtime:0.1.0`` and the like; base is always ``osfarm/base:bookworm``."""
    if kind == "base":
        return BASE_IMAGE
    repo = {"runtime": RUNTIME_REPO, "desktop": DESKTOP_REPO}[kind]
    return f"{repo}:{tag or VERSION}"


def find_source_root(explicit: Path | None = None) -> Path:
    """The osfarm checkout holding ``vm_images/`` (images are built from source)."""
    candidates = [explicit] if explicit else [Path(osfarm.__file__).resolve().parent.parent, Path.cwd()]
    for root in candidates:
        if root and (root / "vm_images" / "desktop" / "Dockerfile").is_file() and (root / "osfarm").is_dir():
            return root.resolve()
    where = ", ".join(str(c) for c in candidates if c)
    raise RecipeError(
        f"no osfarm source checkout with vm_images/ found (looked in {where}); run from the repository "
        "or pass --src DIR"
    )


@dataclass
class Recipe:
    """One image's build context (archive name -> file on disk, or literal bytes) and hash."""

    kind: str
    files: dict[str, Path] = field(default_factory=dict)
    # inputs that change the image without being context files (e.g. sources built into wheels)
    hashed: dict[str, Path] = field(default_factory=dict)
    extra: dict[str, bytes] = field(default_factory=dict)  # not files: settings that change the image

    def add_tree(self, src: Path, arc_prefix: str, hash_only: bool = False) -> None:
        target = self.hashed if hash_only else self.files
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if name.endswith(SKIP_SUFFIXES) or not path.exists():  # a symlink to nothing: nothing to copy
                    continue
                rel = path.relative_to(src).as_posix()
                target[f"{arc_prefix}/{rel}" if arc_prefix else rel] = path

    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"kind={self.kind}\n".encode())
        for key in sorted(self.extra):
            h.update(f"extra {key} {hashlib.sha256(self.extra[key]).hexdigest()}\n".encode())
        both = {**{f"src:{k}": v for k, v in self.hashed.items()}, **self.files}
        for arc in sorted(both):
            path = both[arc]
            mode = path.stat().st_mode & 0o111
            h.update(f"file {arc} {mode:o} {hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
        return h.hexdigest()


def base_recipe(root: Path, mirror: str) -> Recipe:
    r = Recipe("base")
    r.add_tree(root / "vm_images" / "base", "")
    r.extra["debootstrap"] = f"{SUITE} {VARIANT} {mirror}".encode()
    return r


def runtime_recipe(root: Path, base_id: str) -> Recipe:
    """``base_id``: the base's recipe label (or image id for a pulled base)."""
    r = Recipe("runtime")
    r.add_tree(root / "vm_images" / "runtime", "")
    r.add_tree(root / "vm_images" / "base" / "rootfs", "base-rootfs")
    # osfarm and its dependencies go in as wheels built from these (build.py adds them)
    r.hashed["pyproject.toml"] = root / "pyproject.toml"
    r.add_tree(root / "osfarm", "osfarm", hash_only=True)
    r.extra["base"] = base_id.encode()
    return r


# What the desktop image copies from the host that builds it (both installed by `make system`):
# the Ubuntu font family (npm, scripts/setup-fonts.sh) and code-server with its Node (npm, built
# by scripts/setup-vscode.sh: its native modules need a toolchain the image does not carry).
HOST_TREES = {
    "fonts-ubuntu": (Path("/usr/share/fonts/truetype/ubuntu"), "scripts/setup-fonts.sh"),
    "code-server": (Path(os.environ.get("OSFARM_CODE_SERVER", "/usr/lib/osfarm-code-server")),
                    "scripts/setup-vscode.sh"),
}


def desktop_recipe(root: Path, base_id: str, runtime_recipe_hash: str) -> Recipe:
    r = Recipe("desktop")
    r.add_tree(root / "vm_images" / "desktop", "")
    for arc, (src, setup) in HOST_TREES.items():
        if not src.is_dir():
            raise RecipeError(f"the desktop image copies {src}, which is missing: run {setup} (make system) first")
        r.add_tree(src, arc)
    r.add_tree(root / "vm_images" / "base" / "rootfs", "base-rootfs")
    r.files["runtime-packages.txt"] = root / "vm_images" / "runtime" / "packages.txt"
    r.extra["base"] = base_id.encode()
    r.extra["runtime"] = runtime_recipe_hash.encode()
    return r



# Facts of vm_images/desktop/Dockerfile that the Docker and libvirt providers rely on (the VM's disk
# is that image's): the guest's account, the agent's id range (osfarm.desktop.box.agent_world), the
# template of the agent's home. tests/test_docker_provider.py checks them against the Dockerfile.
DESKTOP_GUEST_UID = 0x6FF10000
DESKTOP_AGENT_BASE = 0x6FF00000
DESKTOP_HOME_TEMPLATE = "/usr/share/osfarm/home-template"

def read_packages(path: Path) -> list[str]:
    """Package names of a ``packages.txt`` (one a line, ``#`` comments)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out
