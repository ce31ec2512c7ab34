"""The base image: a Debian rootfs made by debootstrap from Debian's packages, then ``docker import``.

No registry is needed: debootstrap downloads .deb files from the Debian mirror (kept in a cache
dir for the next build), ``vm_images/base/rootfs/`` adds apt sources and dpkg/apt settings, and
the tree is streamed into the daemon as an image with our labels.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from osfarm.errors import OsfarmError
from osfarm.images.recipes import LABEL_KIND, LABEL_RECIPE, LABEL_VERSION, SUITE, VARIANT, VERSION, read_packages

Progress = Callable[[str], None]
# debootstrap's "I: <Phase> <package>..." lines
PHASE = re.compile(r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring|Installing|Resolving)\b ?(.*)")
TAIL_LINES = 40


class BaseBuildError(OsfarmError, RuntimeError):
    """debootstrap or the import failed; the message says why and where the log is."""


def check_debootstrap() -> str:
    exe = shutil.which("debootstrap") or ("/usr/sbin/debootstrap" if os.path.exists("/usr/sbin/debootstrap") else None)
    if exe is None:
        raise BaseBuildError(
            "debootstrap is not installed: apt-get install debootstrap "
            "(or use a pulled base: --base debian:bookworm-slim)"
        )
    if os.geteuid() != 0:
        raise BaseBuildError(
            "building the base image with debootstrap needs root (it creates device nodes and chroots): "
            "run `sudo osfarm image build`, or use a pulled base: --base debian:bookworm-slim"
        )
    return exe


def debootstrap_rootfs(root: Path, work: Path, mirror: str, cache_dir: Path, log_path: Path, on_line: Progress) -> Path:
    """Run debootstrap into ``work/rootfs`` and lay ``vm_images/base/rootfs`` over it."""
    exe = check_debootstrap()
    rootfs = work / "rootfs"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    cache_dir.mkdir(parents=True, exist_ok=True)
    include = ",".join(read_packages(root / "vm_images" / "base" / "packages.txt"))
    cmd = [exe, f"--variant={VARIANT}", f"--cache-dir={cache_dir}", "--components=main", "--merged-usr"]
    if include:
        cmd.append(f"--include={include}")
    cmd += [SUITE, str(rootfs), mirror]
    tail: list[str] = []
    with open(log_path, "w") as logf:
        logf.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            line = line.rstrip()
            tail = (tail + [line])[-TAIL_LINES:]
            m = PHASE.match(line)
            if m:
                on_line(f"debootstrap: {m.group(1).lower()} {m.group(2).rstrip('.')}".rstrip())
        code = proc.wait()
    if code != 0:
        raise BaseBuildError(f"debootstrap failed (exit {code}); log {log_path}:\n" + "\n".join(tail[-15:]))
    overlay = root / "vm_images" / "base" / "rootfs"
    shutil.copytree(overlay, rootfs, dirs_exist_ok=True, symlinks=True)
    # Nothing of the build's package downloads or indexes stays in the image.
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        d = rootfs / sub
        for p in d.glob("*") if d.is_dir() else ():
            if p.is_file():
                p.unlink()
    return rootfs


def import_rootfs(client, rootfs: Path, ref: str, recipe: str, on_line: Progress) -> str:
    """Stream ``rootfs`` as a tar into ``docker import``; returns the image id."""
    repo, tag = ref.rsplit(":", 1)
    changes = [
        f"LABEL {LABEL_RECIPE}={recipe} {LABEL_VERSION}={VERSION} {LABEL_KIND}=base",
        "ENV LANG=C.UTF-8",
        'CMD ["/bin/bash"]',
    ]
    on_line("docker import")
    tar = subprocess.Popen(
        ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", "-", "."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert tar.stdout is not None
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(tar.stderr.read() if tar.stderr else b""), daemon=True)
    reader.start()
    try:
        out = client.api.import_image_from_stream(_chunks(tar.stdout), repository=repo, tag=tag, changes=changes)
    finally:
        code = tar.wait()
        reader.join(5)
    if code != 0:
        raise BaseBuildError(f"tar of {rootfs} failed (exit {code}): {b''.join(err).decode(errors='replace')[-500:]}")
    image = client.images.get(ref)
    if not image.labels.get(LABEL_RECIPE) == recipe:
        raise BaseBuildError(f"docker import did not produce {ref} with our labels: {str(out)[-300:]}")
    return image.id


def _chunks(f, size: int = 1 << 20):
    while True:
        b = f.read(size)
        if not b:
            return
        yield b


def build_base(client, root: Path, recipe: str, mirror: str, cache_dir: Path, log_dir: Path, on_line: Progress,
               ref: str) -> str:
    work = Path(tempfile.mkdtemp(prefix="osfarm-base-", dir=str(cache_dir.parent)))
    try:
        rootfs = debootstrap_rootfs(root, work, mirror, cache_dir, log_dir / "base.log", on_line)
        return import_rootfs(client, rootfs, ref, recipe, on_line)
    finally:
        shutil.rmtree(work, ignore_errors=True)
