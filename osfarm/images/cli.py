"""``osfarm image build | ls``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from osfarm.images import recipes

image_app = typer.Typer(help="Build and list the desktop images (Docker; libvirt disks are made from them).",
                        no_args_is_help=True)
out = Console()
err = Console(stderr=True)


def default_work_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/cache/osfarm/images")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "osfarm" / "images"


def _fail(msg: str) -> None:
    err.print(f"[red]error:[/red] {msg}", highlight=False)
    raise typer.Exit(1)


@image_app.command("build")
def build_command(
    base: Annotated[str | None, typer.Option(
        "--base", help="use this local image as the base (e.g. debian:bookworm-slim) instead of the debootstrap one"
    )] = None,
    only: Annotated[str | None, typer.Option(
        "--only", help="build this image and what it needs: base, runtime or desktop (default: all)"
    )] = None,
    force: Annotated[bool, typer.Option("--force", help="rebuild even when the recipe label matches")] = False,
    mirror: Annotated[str, typer.Option("--mirror", envvar="OSFARM_DEBIAN_MIRROR",
                                        help="Debian mirror for debootstrap")] = recipes.DEFAULT_MIRROR,
    src: Annotated[Path | None, typer.Option("--src", help="osfarm source checkout (default: this one)")] = None,
    work_dir: Annotated[Path | None, typer.Option(
        "--work-dir", help="package cache and build logs (default /var/cache/osfarm/images as root)"
    )] = None,
) -> None:
    """Build osfarm/base:bookworm (debootstrap), osfarm/runtime and osfarm/desktop.

    An image whose org.osfarm.recipe label matches the checkout's recipe is kept as it is.
    """
    from osfarm.images.build import BuildResult, Events, ImageBuilder, ImageBuildError
    from osfarm.images.daemon import DockerUnavailable, docker_client
    from osfarm.images.debootstrap import BaseBuildError

    if only is not None and only not in recipes.IMAGES:
        _fail(f"--only {only!r}: choose one of {', '.join(recipes.IMAGES)}")
    if base is not None and only == "base":
        _fail("--only base builds the debootstrap base; it makes no sense with --base")
    try:
        client = docker_client(timeout=3600)
        builder = ImageBuilder(client, src=src, base=base, mirror=mirror, work_dir=work_dir or default_work_dir(),
                               force=force)
    except (DockerUnavailable, recipes.RecipeError, ImageBuildError) as e:
        _fail(str(e))
    results: list[BuildResult] = []
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[kind]:<8}"), BarColumn(bar_width=20),
                  MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}"),
                  console=err, transient=False) as progress:
        tasks: dict[str, TaskID] = {}

        def start(kind: str) -> None:
            tasks[kind] = progress.add_task("starting", kind=kind, total=None)

        def line(kind: str, text: str) -> None:
            if kind in tasks:
                progress.update(tasks[kind], description=text[:90])

        def steps(kind: str, n: int, total: int) -> None:
            if kind in tasks:
                progress.update(tasks[kind], total=total, completed=n - 1)

        def done(res: BuildResult) -> None:
            results.append(res)
            if res.kind in tasks:
                t = progress.tasks[tasks[res.kind]]
                progress.update(tasks[res.kind], completed=t.total or 1, total=t.total or 1,
                                description=f"[green]built[/green] {res.ref} in {res.seconds:.0f}s")
                progress.stop_task(tasks[res.kind])
            else:
                progress.console.print(f"{res.kind:<8} {res.ref}: {res.status}")

        try:
            builder.build(only=only, events=Events(start=start, line=line, steps=steps, done=done))
        except (ImageBuildError, BaseBuildError, DockerUnavailable) as e:
            progress.stop()
            _fail(str(e))
    table = Table(title="osfarm images")
    for col in ("image", "status", "build s", "size MB", "id"):
        table.add_column(col)
    for r in results:
        table.add_row(r.ref, r.status, f"{r.seconds:.0f}", f"{r.size_mb:.0f}", r.image_id.split(":")[-1][:12])
    out.print(table)


@image_app.command("ls")
def ls_command(
    json_out: Annotated[bool, typer.Option("--json", help="print JSON rows")] = False,
    all_images: Annotated[bool, typer.Option("--all", help="also untagged images left by earlier builds")] = False,
) -> None:
    """List osfarm's images on this docker host, with their version and recipe labels."""
    import json

    from osfarm.images.build import list_images
    from osfarm.images.daemon import DockerUnavailable, docker_client

    try:
        rows = list_images(docker_client(timeout=30), dangling=all_images)
    except DockerUnavailable as e:
        _fail(str(e))
    if json_out:
        print(json.dumps(rows, indent=1))
        return
    table = Table(title="osfarm images")
    for col in ("image", "kind", "version", "recipe", "size MB", "created", "id"):
        table.add_column(col, no_wrap=col == "image")
    for r in rows:
        table.add_row(r["ref"], r["kind"], r["version"], r["recipe"], f"{r['size_mb']:.0f}", r["created"], r["id"])
    out.print(table)
    if not rows:
        out.print("no osfarm images yet: run `osfarm image build`")


# `osfarm image build-vm`: the libvirt VM disk made from the desktop image (H2's module).
from osfarm.images.libvirt_disk import build_vm_command  # noqa: E402

image_app.command("build-vm")(build_vm_command)
