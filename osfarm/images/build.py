"""Building osfarm's images: base (debootstrap) -> runtime -> desktop.

Builds go through the Docker SDK's build API (the classic builder) rather than the docker CLI:
the CLI on a machine may be 20.10 (Debian's docker.io) or 28.x without buildx, which behave
differently; the API streams structured progress for the rich display, and the build context is
an exact tar of the recipe's files (the same list the recipe hash covers), never the whole
checkout with its venv. Every build runs with ``network_mode=host``: our dockerd runs with
``--bridge=none``, where the default build network does not exist.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from osfarm.errors import OsfarmError
from osfarm.images import recipes
from osfarm.images.debootstrap import build_base
from osfarm.images.recipes import LABEL_KIND, LABEL_RECIPE, LABEL_VERSION, VERSION, Recipe, image_ref

STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)")
TAIL_LINES = 40


class ImageBuildError(OsfarmError, RuntimeError):
    """An image could not be built; the message says which, why, and where the log is."""


@dataclass
class ImageStatus:
    kind: str
    ref: str
    recipe: str
    current: bool  # an image with this ref and recipe label exists
    image_id: str | None = None


@dataclass
class BuildResult:
    kind: str
    ref: str
    status: str  # built | up to date | given
    seconds: float
    image_id: str
    size_mb: float


class Events:
    """What the builder reports: override or pass callables (the CLI draws rich progress)."""

    def __init__(self, start: Callable[[str], None] | None = None, line: Callable[[str, str], None] | None = None,
                 steps: Callable[[str, int, int], None] | None = None,
                 done: Callable[[BuildResult], None] | None = None):
        self.start = start or (lambda kind: None)
        self.line = line or (lambda kind, text: None)
        self.steps = steps or (lambda kind, n, total: None)
        self.done = done or (lambda result: None)


class ImageBuilder:
    """``base``: None for the debootstrap base, else a local image ref (e.g. debian:bookworm-slim)."""

    def __init__(self, client: Any, src: Path | None = None, base: str | None = None,
                 mirror: str = recipes.DEFAULT_MIRROR, work_dir: Path | None = None, force: bool = False):
        self.client = client
        self.root = recipes.find_source_root(src)
        self.base = base
        self.mirror = mirror
        self.work_dir = (work_dir or Path("/var/cache/osfarm/images")).absolute()
        self.force = force

    # -- planning ---------------------------------------------------------------------------

    def _image(self, ref: str) -> Any:
        from docker.errors import ImageNotFound

        try:
            return self.client.images.get(ref)
        except ImageNotFound:
            return None

    def base_ref(self) -> str:
        return self.base or recipes.BASE_IMAGE

    def base_identity(self) -> str:
        """What the base contributes to the runtime/desktop recipes."""
        if self.base is None:
            return recipes.base_recipe(self.root, self.mirror).digest()
        img = self._image(self.base)
        if img is None:
            raise ImageBuildError(
                f"--base {self.base}: no such image on this docker host; pull it first (`docker pull {self.base}`) "
                "or build the offline base (omit --base)"
            )
        return img.id

    def recipes(self) -> dict[str, Recipe]:
        base_id = self.base_identity()
        out: dict[str, Recipe] = {}
        if self.base is None:
            out["base"] = recipes.base_recipe(self.root, self.mirror)
        out["runtime"] = recipes.runtime_recipe(self.root, base_id)
        out["desktop"] = recipes.desktop_recipe(self.root, base_id, out["runtime"].digest())
        return out

    def status(self) -> list[ImageStatus]:
        out = []
        for kind, recipe in self.recipes().items():
            ref = image_ref(kind)
            digest = recipe.digest()
            img = self._image(ref)
            current = img is not None and img.labels.get(LABEL_RECIPE) == digest
            out.append(ImageStatus(kind, ref, digest, current, img.id if img is not None else None))
        return out

    # -- building ---------------------------------------------------------------------------

    def build(self, only: str | None = None, events: Events | None = None) -> list[BuildResult]:
        """Build ``only`` and the images it needs (default: all), skipping up-to-date ones."""
        ev = events or Events()
        order = ["base", "runtime", "desktop"]
        wanted = order[: order.index(only) + 1] if only else order
        plan = self.recipes()
        log_dir = self.work_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        results = []
        for kind in wanted:
            if kind == "base" and self.base is not None:
                img = self._image(self.base)
                res = BuildResult(kind, self.base, "given", 0.0, img.id, img.attrs.get("Size", 0) / 1e6)
                ev.done(res)
                results.append(res)
                continue
            ref = image_ref(kind)
            digest = plan[kind].digest()
            img = self._image(ref)
            if img is not None and img.labels.get(LABEL_RECIPE) == digest and not self.force:
                res = BuildResult(kind, ref, "up to date", 0.0, img.id, img.attrs.get("Size", 0) / 1e6)
                ev.done(res)
                results.append(res)
                continue
            ev.start(kind)
            t0 = time.monotonic()
            if kind == "base":
                image_id = build_base(
                    self.client, self.root, digest, self.mirror, self.work_dir / "debs", log_dir,
                    lambda text: ev.line("base", text), ref,
                )  # fmt: skip
            else:
                image_id = self._docker_build(kind, plan[kind], ref, log_dir / f"{kind}.log", ev)
            if kind != "base":
                repo = ref.rsplit(":", 1)[0]
                self.client.api.tag(image_id, repo, "latest")
            img = self.client.images.get(image_id)
            self._prune(kind)
            res = BuildResult(kind, ref, "built", time.monotonic() - t0, image_id, img.attrs.get("Size", 0) / 1e6)
            ev.done(res)
            results.append(res)
        return results

    def _prune(self, kind: str) -> None:
        """Drop the untagged images an earlier build of ``kind`` left (their unshared layers are
        disk space); images still used by a container or a child image are kept by the daemon."""
        from docker.errors import DockerException

        try:
            self.client.images.prune(filters={"dangling": True, "label": f"{LABEL_KIND}={kind}"})
        except DockerException:
            pass

    def _wheels(self) -> dict[str, Path]:
        """Wheels of osfarm[docker,queue] and all its dependencies, made with this host's pip
        (its index, proxy and CA settings), for an image build that needs no index."""
        out = self.work_dir / "wheels"
        shutil.rmtree(out, ignore_errors=True)  # no stale versions next to new ones
        deps, own = out / "deps", out / "osfarm"
        own.mkdir(parents=True)
        # From a copy of the sources: setuptools leaves build/ and *.egg-info where it builds,
        # and a stale build/lib could put deleted modules into the wheel.
        src = out / "src"
        shutil.copytree(self.root / "osfarm", src / "osfarm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(self.root / name, src / name)
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(deps), f"{src}[docker,queue]"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        shutil.rmtree(src, ignore_errors=True)
        if proc.returncode != 0:
            raise ImageBuildError(f"pip wheel for the runtime image failed (exit {proc.returncode}):\n"
                                  f"{(proc.stderr or proc.stdout)[-2000:]}")
        for whl in deps.glob("osfarm-*.whl"):
            whl.rename(own / whl.name)
        files = {f"wheels/deps/{p.name}": p for p in sorted(deps.glob("*.whl"))}
        files.update({f"wheels/osfarm/{p.name}": p for p in sorted(own.glob("*.whl"))})
        if not any(k.startswith("wheels/osfarm/") for k in files):
            raise ImageBuildError(f"pip wheel made no osfarm wheel in {deps}")
        return files

    def _docker_build(self, kind: str, recipe: Recipe, ref: str, log_path: Path, ev: Events) -> str:
        from docker.errors import APIError, BuildError

        files = dict(recipe.files)
        if kind == "runtime":
            ev.line(kind, "pip wheel: osfarm[docker,queue] and its dependencies")
            files.update(self._wheels())
        context = _context_tar(files)
        buildargs = {"BASE_IMAGE": self.base_ref(), "RUNTIME_IMAGE": image_ref("runtime")}
        labels = {LABEL_RECIPE: recipe.digest(), LABEL_VERSION: VERSION, LABEL_KIND: kind}
        tail: list[str] = []
        image_id = None
        t0 = time.monotonic()
        with open(log_path, "w") as logf:
            try:
                stream = self.client.api.build(
                    fileobj=context, custom_context=True, tag=ref, rm=True, forcerm=True, pull=False,
                    network_mode="host", buildargs=buildargs, labels=labels, decode=True,
                )  # fmt: skip
                for chunk in stream:
                    if "error" in chunk:
                        text = chunk.get("error", "").strip()
                        logf.write(text + "\n")
                        raise ImageBuildError(
                            f"building {ref} failed: {text}\nlog {log_path}, last lines:\n" + "\n".join(tail[-15:])
                        )
                    if "aux" in chunk and isinstance(chunk["aux"], dict) and "ID" in chunk["aux"]:
                        image_id = chunk["aux"]["ID"]
                    text = chunk.get("stream") or chunk.get("status") or ""
                    if not text:
                        continue
                    if STEP.match(text):  # step start times, for the build-time figures
                        logf.write(f"[{time.monotonic() - t0:7.1f}s] ")
                    logf.write(text if text.endswith("\n") else text + "\n")
                    logf.flush()
                    for line in text.splitlines():
                        line = line.rstrip()
                        if not line:
                            continue
                        tail = (tail + [line])[-TAIL_LINES:]
                        m = STEP.match(line)
                        if m:
                            ev.steps(kind, int(m.group(1)), int(m.group(2)))
                            ev.line(kind, m.group(3))
                        elif not line.startswith(" --->"):
                            ev.line(kind, line)
            except (APIError, BuildError) as e:
                raise ImageBuildError(f"building {ref} failed: {e}; log {log_path}") from None
        if image_id is None:
            image_id = self.client.images.get(ref).id
        return image_id


def _context_tar(files: dict[str, Path]) -> Any:
    """The build context: exactly these files (modes kept, owners root, fixed mtimes)."""
    buf = tempfile.TemporaryFile()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for arc in sorted(files):
            path = files[arc]
            info = tar.gettarinfo(str(path), arcname=arc)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            if info.isfile():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    buf.seek(0)
    return buf


def list_images(client: Any, dangling: bool = False) -> list[dict[str, Any]]:
    """osfarm's images on this docker host (one row per tag; untagged ones only with ``dangling``)."""
    rows = []
    for img in client.images.list(filters={"label": LABEL_KIND}):
        if not img.tags and not dangling:
            continue
        for tag in img.tags or ["<none>"]:
            rows.append({
                "ref": tag,
                "id": img.short_id.split(":", 1)[-1],
                "kind": img.labels.get(LABEL_KIND, ""),
                "version": img.labels.get(LABEL_VERSION, ""),
                "recipe": img.labels.get(LABEL_RECIPE, "")[:12],
                "size_mb": img.attrs.get("Size", 0) / 1e6,
                "created": img.attrs.get("Created", "")[:19].replace("T", " "),
            })  # fmt: skip
    order = {k: i for i, k in enumerate(recipes.IMAGES)}
    rows.sort(key=lambda r: (order.get(r["kind"], 9), r["ref"]))
    return rows
