"""The libvirt VM disk: the Docker desktop's rootfs as a bootable qcow2, plus its kernel and initrd.

``build_libvirt_disk(out_dir)``:

1. ``docker build`` of ``vm_images/libvirt/Dockerfile`` (``osfarm/desktop-vm``: the desktop image
   plus a kernel, a small initrd that mounts a virtio disk, and ``/sbin/osfarm-init``),
2. ``docker create`` + ``docker export`` piped into ``tar`` -> a rootfs directory,
3. ``vmlinuz`` and ``initrd.img`` copied out of its ``/boot``,
4. ``mkfs.ext4 -d rootfs`` into a sparse raw file (the rootfs plus free space for tasks),
5. ``qemu-img convert -O qcow2`` -> ``base.qcow2`` (zero blocks dropped: small on disk).

The result is cached: ``build.json`` records the ``desktop-vm`` image id it was made from, and a
build whose image id is unchanged (docker's layer cache makes the image step a no-op when the
recipe is unchanged) returns at once. Needs root (the rootfs keeps its owners) and, for step 1,
a running dockerd.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from osfarm.errors import OsfarmError

VM_IMAGE = "osfarm/desktop-vm"
DESKTOP_IMAGE = "osfarm/desktop:latest"
BASE_DISK = "base.qcow2"
KERNEL = "vmlinuz"
INITRD = "initrd.img"
MANIFEST = "build.json"
# Bump when the disk layout made from an image changes (not the image: its id covers that).
DISK_RECIPE = 1
GIB = 1 << 30
RECIPE_LABEL = "org.osfarm.recipe"  # the desktop image's recipe hash (osfarm/images/recipes.py)


class DiskBuildError(OsfarmError, RuntimeError):
    """The VM disk could not be built; the message says what is missing and how to fix it."""


@dataclass
class DiskBuild:
    out_dir: str
    image: str
    image_id: str
    recipe: int
    built_at: float
    build_s: float
    rootfs_bytes: int
    virtual_bytes: int
    base_disk_bytes: int
    kernel: str
    initrd: str
    recipe_key: str | None = None
    cached: bool = False


def vm_recipe_dir() -> Path:
    """``vm_images/libvirt`` of this source tree (or ``$OSFARM_VM_IMAGES/libvirt``)."""
    env = os.environ.get("OSFARM_VM_IMAGES")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "vm_images"
    d = root / "libvirt"
    if not (d / "Dockerfile").is_file():
        raise DiskBuildError(
            f"{d}/Dockerfile not found: run from an osfarm source tree or set OSFARM_VM_IMAGES to its vm_images dir"
        )
    return d


def default_image_dir() -> Path:
    """Where the VM disk lives unless ``libvirt_image_dir`` says otherwise: one per machine
    (a few GB, built once), next to the image build cache."""
    if os.geteuid() == 0:
        return Path("/var/cache/osfarm/libvirt")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "osfarm" / "libvirt"


def disk_files(out_dir: Path) -> dict[str, Path]:
    return {"base": out_dir / BASE_DISK, "kernel": out_dir / KERNEL, "initrd": out_dir / INITRD}


def missing_files(out_dir: Path) -> list[str]:
    return [str(p) for p in disk_files(out_dir).values() if not p.is_file()]


def disk_size_bytes(rootfs_bytes: int, free_gib: float) -> int:
    """Virtual size of the VM disk: the rootfs with 15% ext4 overhead (inodes, journal, slack)
    plus ``free_gib`` of free space for tasks, rounded up to a whole MiB."""
    raw = int(rootfs_bytes * 1.15) + int(free_gib * GIB)
    mib = 1 << 20
    return (raw + mib - 1) // mib * mib


def _run(cmd: list[str], what: str, **kw) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    except FileNotFoundError:
        raise DiskBuildError(f"{cmd[0]} not found: {what} needs it (apt-get install {_package_of(cmd[0])})") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-20:])
        raise DiskBuildError(f"{what} failed ({' '.join(cmd[:3])} ... exit {proc.returncode}):\n{tail}")
    return proc


def _package_of(tool: str) -> str:
    return {"docker": "docker.io", "mkfs.ext4": "e2fsprogs", "qemu-img": "qemu-utils", "tar": "tar"}.get(tool, tool)


def image_id(image: str) -> str | None:
    proc = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True,
                          text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def image_label(image: str, label: str) -> str | None:
    proc = subprocess.run(
        ["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{label}"}}}}', image],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    value = proc.stdout.strip()
    return value if proc.returncode == 0 and value and value != "<no value>" else None


def vm_recipe_key(base_image: str) -> str | None:
    """What the disk is made from: the desktop image's recipe label (or its id, when it has no
    label), this directory's recipe files and DISK_RECIPE. None when the desktop image is missing."""
    base = image_label(base_image, RECIPE_LABEL) or image_id(base_image)
    if base is None:
        return None
    h = hashlib.sha256(f"{base}\n{DISK_RECIPE}\n".encode())
    recipe = vm_recipe_dir()
    for path in sorted(p for p in recipe.iterdir() if p.is_file()):
        h.update(f"{path.name}\n{path.stat().st_mode & 0o777:o}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def build_vm_image(base_image: str = DESKTOP_IMAGE, tag: str = f"{VM_IMAGE}:latest") -> str:
    """``docker build`` of the VM image on top of ``base_image``; returns its image id."""
    if shutil.which("docker") is None:
        raise DiskBuildError("docker not found: apt-get install docker.io (the VM disk is made from the desktop image)")
    if image_id(base_image) is None:
        raise DiskBuildError(
            f"image {base_image} not found: build the desktop image first (`osfarm image build`)"
        )
    recipe = vm_recipe_dir()
    _run(
        ["docker", "build", "--network", "host", "--build-arg", f"BASE_IMAGE={base_image}", "-t", tag, str(recipe)],
        f"docker build of {tag} from {recipe}",
    )
    built = image_id(tag)
    if built is None:
        raise DiskBuildError(f"docker build reported success but {tag} is missing")
    return built


def _read_manifest(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _write_manifest(out_dir: Path, data: dict) -> None:
    tmp = out_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, out_dir / MANIFEST)


def _export_rootfs(image: str, rootfs: Path) -> None:
    """``docker create`` + ``docker export | tar -x``: the image's filesystem, owners kept."""
    name = f"osfarm-vmexport-{uuid.uuid4().hex[:8]}"
    _run(["docker", "create", "--name", name, image, "/bin/true"], f"docker create from {image}")
    try:
        rootfs.mkdir(parents=True)
        export = subprocess.Popen(["docker", "export", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        untar = subprocess.run(
            ["tar", "-x", "-p", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-C", str(rootfs), "-f", "-"],
            stdin=export.stdout, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert export.stdout is not None
        export.stdout.close()
        err = export.stderr.read().decode(errors="replace") if export.stderr else ""
        if export.wait() != 0:
            raise DiskBuildError(f"docker export of {image} failed: {err.strip()}")
        if untar.returncode != 0:
            raise DiskBuildError(f"unpacking the rootfs of {image} into {rootfs} failed: "
                                 f"{untar.stderr.strip()[-2000:]}")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    # Docker leaves its marker and empty bind-mount targets; the VM's init writes its own.
    (rootfs / ".dockerenv").unlink(missing_ok=True)


def _tree_bytes(root: Path) -> int:
    proc = _run(["du", "-s", "-B1", "--apparent-size", str(root)], "measuring the rootfs")
    return int(proc.stdout.split()[0])


def _boot_file(rootfs: Path, pattern: str) -> Path:
    found = sorted((rootfs / "boot").glob(pattern))
    if not found:
        raise DiskBuildError(f"no /boot/{pattern} in the VM image: its Dockerfile must install linux-image-amd64")
    return found[-1]


def build_libvirt_disk(
    out_dir: Path,
    *,
    base_image: str = DESKTOP_IMAGE,
    image: str = f"{VM_IMAGE}:latest",
    free_gib: float = 4.0,
    force: bool = False,
    build_image: bool = True,
    step: Callable[[str], None] = lambda _msg: None,
) -> DiskBuild:
    """Build (or reuse) ``out_dir``/{base.qcow2, vmlinuz, initrd.img}; see the module doc.

    ``step`` is called with a short description before each phase (progress display).
    ``build_image=False`` uses ``image`` as it is (no docker build).
    """
    t0 = time.monotonic()
    out_dir = Path(out_dir).absolute()
    if os.geteuid() != 0:
        raise DiskBuildError("building the VM disk needs root (the rootfs must keep its file owners): run it with sudo")
    for tool in ("docker", "tar", "mkfs.ext4", "qemu-img"):
        if shutil.which(tool) is None:
            raise DiskBuildError(f"{tool} not found: apt-get install {_package_of(tool)}")
    key = vm_recipe_key(base_image) if build_image else None
    old = _read_manifest(out_dir)
    if (not force and old is not None and key is not None and old.get("recipe_key") == key
            and not missing_files(out_dir)):
        # Same desktop recipe, same VM recipe: skip even the docker build (the desktop image may
        # have been rebuilt with a new id from the same recipe).
        step("VM disk is up to date")
        return DiskBuild(**{**old, "cached": True})
    if build_image:
        step(f"docker build {image} (FROM {base_image})")
        img_id = build_vm_image(base_image, image)
    else:
        found = image_id(image)
        if found is None:
            raise DiskBuildError(f"image {image} not found: build it (`osfarm image build-vm`)")
        img_id = found
    if (
        not force
        and old is not None
        and old.get("image_id") == img_id
        and old.get("recipe") == DISK_RECIPE
        and not missing_files(out_dir)
    ):
        step("VM disk is up to date")
        if key is not None and old.get("recipe_key") != key:
            _write_manifest(out_dir, {**old, "recipe_key": key})
        return DiskBuild(**{**old, "recipe_key": key, "cached": True})

    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / f".build-{uuid.uuid4().hex[:8]}"
    try:
        rootfs = work / "rootfs"
        step(f"export the rootfs of {image}")
        _export_rootfs(image, rootfs)
        rootfs_bytes = _tree_bytes(rootfs)
        need = disk_size_bytes(rootfs_bytes, 0) * 2  # raw image + qcow2, both at most the data size
        free = shutil.disk_usage(out_dir).free
        if free < need:
            raise DiskBuildError(
                f"not enough free space in {out_dir}: {free / GIB:.1f} GiB free, about {need / GIB:.1f} GiB needed"
            )
        shutil.copyfile(_boot_file(rootfs, "vmlinuz-*"), work / KERNEL)
        shutil.copyfile(_boot_file(rootfs, "initrd.img-osfarm"), work / INITRD)

        size = disk_size_bytes(rootfs_bytes, free_gib)
        raw = work / "root.raw"
        step(f"mkfs.ext4 -d rootfs ({rootfs_bytes / GIB:.2f} GiB of files, {size / GIB:.1f} GiB disk)")
        with open(raw, "wb") as f:
            f.truncate(size)
        _run(
            ["mkfs.ext4", "-q", "-F", "-L", "osfarm-root", "-b", "4096", "-m", "0",
             "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", "-d", str(rootfs), str(raw)],
            "mkfs.ext4 of the VM disk",
        )  # fmt: skip
        step("qemu-img convert -> base.qcow2")
        _run(
            ["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=65536",
             str(raw), str(work / BASE_DISK)],
            "qemu-img convert of the VM disk",
        )  # fmt: skip
        raw.unlink()
        # Desktops' overlays name base.qcow2 as their backing file and never write to it.
        os.chmod(work / BASE_DISK, 0o444)
        for name in (BASE_DISK, KERNEL, INITRD):
            os.replace(work / name, out_dir / name)
        result = DiskBuild(
            out_dir=str(out_dir),
            image=image,
            image_id=img_id,
            recipe=DISK_RECIPE,
            built_at=time.time(),
            build_s=round(time.monotonic() - t0, 1),
            rootfs_bytes=rootfs_bytes,
            virtual_bytes=size,
            base_disk_bytes=(out_dir / BASE_DISK).stat().st_blocks * 512,
            kernel=str(out_dir / KERNEL),
            initrd=str(out_dir / INITRD),
            recipe_key=key,
        )
        _write_manifest(out_dir, asdict(result))
        return result
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)


def build_vm_command(
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="where base.qcow2, vmlinuz and initrd.img go "
                     "(default: OSFARM_LIBVIRT_IMAGE_DIR, else /var/cache/osfarm/libvirt as root)", show_default=False),
    ] = None,
    base_image: Annotated[str, typer.Option("--from", help="desktop image the VM image is built on")] = DESKTOP_IMAGE,
    free_gib: Annotated[float, typer.Option("--free-gib", help="free space on the VM disk for tasks (GiB)")] = 4.0,
    force: Annotated[bool, typer.Option("--force", help="rebuild the disk even if it is up to date")] = False,
) -> None:
    """Build the libvirt VM disk (osfarm/desktop-vm -> base.qcow2 + vmlinuz + initrd.img). Needs root and dockerd."""
    console = Console(stderr=True)
    target = out_dir or Path(os.environ.get("OSFARM_LIBVIRT_IMAGE_DIR") or default_image_dir())
    t0 = time.monotonic()
    with console.status("building the VM disk") as status:

        def step(msg: str) -> None:
            console.log(msg)
            status.update(msg)

        try:
            result = build_libvirt_disk(target, base_image=base_image, free_gib=free_gib, force=force, step=step)
        except DiskBuildError as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(1) from None
    what = "up to date" if result.cached else f"built in {time.monotonic() - t0:.0f} s"
    console.print(
        f"VM disk {what}: {result.out_dir}/{BASE_DISK} ({result.base_disk_bytes / GIB:.2f} GiB on disk, "
        f"{result.virtual_bytes / GIB:.1f} GiB virtual, rootfs {result.rootfs_bytes / GIB:.2f} GiB) "
        f"from {result.image} {result.image_id[:19]}"
    )
