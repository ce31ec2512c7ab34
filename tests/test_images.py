"""osfarm's images: built once (a second `osfarm image build` keeps them), labelled with the
version and recipe, a package manifest inside, and the OSWorld VM's compatibility points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from osfarm import __version__
from osfarm.images import recipes
from osfarm.images.recipes import Recipe
from osfarm.testing.docker_env import docker_or_skip, ensure_images

ROOT = Path(__file__).resolve().parent.parent
OSFARM = [sys.executable, "-m", "osfarm.cli"]


def run_in(image: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "run", "--rm", "--network", "none", image, "bash", "-c", script],
                          capture_output=True, text=True, timeout=120)


# -- recipe hashing (no docker) ---------------------------------------------------------------


def test_recipe_digest_follows_content_and_mode(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    f = tmp_path / "a" / "x.sh"
    f.write_text("echo 1\n")
    (tmp_path / "a" / "__pycache__").mkdir()
    (tmp_path / "a" / "__pycache__" / "x.pyc").write_bytes(b"junk")

    def digest() -> str:
        r = Recipe("t")
        r.add_tree(tmp_path / "a", "ctx")
        return r.digest()

    d0 = digest()
    assert digest() == d0
    (tmp_path / "a" / "__pycache__" / "x.pyc").write_bytes(b"other junk")
    assert digest() == d0, "caches must not change the recipe"
    f.write_text("echo 2\n")
    d1 = digest()
    assert d1 != d0
    f.chmod(0o755)
    assert digest() != d1, "an executable bit changes the image"


def test_recipes_chain_parent_hashes() -> None:
    base = recipes.base_recipe(ROOT, recipes.DEFAULT_MIRROR)
    assert base.digest() != recipes.base_recipe(ROOT, "http://mirror.example/debian").digest()
    rt = recipes.runtime_recipe(ROOT, base.digest())
    assert "wheels" not in " ".join(rt.files)  # added at build time, outside the hash
    assert any(k.startswith("osfarm/") for k in rt.hashed)
    assert rt.digest() != recipes.runtime_recipe(ROOT, "another-base").digest()
    d1 = recipes.desktop_recipe(ROOT, base.digest(), rt.digest())
    assert d1.digest() != recipes.desktop_recipe(ROOT, base.digest(), "another-runtime").digest()


def test_desktop_packages_cover_the_host_desktop_packages() -> None:
    """The image has what the sandbox desktops get from scripts/system-packages.txt."""
    host_only = {"make", "openssl", "python3-dev", "python3-venv", "util-linux"}
    text = (ROOT / "scripts" / "system-packages.txt").read_text()
    # The desktop part: everything before the first section appended for another part.
    lines = text.split("\n# apps and helpers OSWorld tasks expect", 1)[0].splitlines()
    host = {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
    image = set(recipes.read_packages(ROOT / "vm_images" / "desktop" / "packages.txt"))
    image |= set(recipes.read_packages(ROOT / "vm_images" / "runtime" / "packages.txt"))
    assert host - host_only - image == set()


def test_bad_build_options_are_named() -> None:
    r = subprocess.run([*OSFARM, "image", "build", "--only", "bogus"], capture_output=True, text=True)
    assert r.returncode != 0 and "--only 'bogus'" in r.stderr and "Traceback" not in r.stderr


# -- the built images -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built() -> str:
    return ensure_images("desktop")


@pytest.mark.timeout(3600)
def test_second_build_keeps_up_to_date_images(built: str) -> None:
    refs = ("osfarm/base:bookworm", f"osfarm/runtime:{__version__}", f"osfarm/desktop:{__version__}")
    # Another run is only a rebuild when osfarm's sources changed in between (a checkout being
    # edited); a quiet checkout (CI) is up to date at the first try.
    for _ in range(3):
        r = subprocess.run([*OSFARM, "image", "build"], capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr
        if all(f"{ref}: up to date" in r.stderr for ref in refs):
            return
    raise AssertionError(f"images rebuilt on every run:\n{r.stderr}")


def test_labels_and_ls(built: str) -> None:
    import docker

    client = docker.from_env()
    for kind in recipes.IMAGES:
        img = client.images.get(recipes.image_ref(kind))
        assert img.labels[recipes.LABEL_VERSION] == __version__
        assert len(img.labels[recipes.LABEL_RECIPE]) == 64
        assert img.labels[recipes.LABEL_KIND] == kind
    assert client.images.get("osfarm/desktop:latest").id == client.images.get(recipes.image_ref("desktop")).id
    r = subprocess.run([*OSFARM, "image", "ls", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {row["ref"]: row for row in json.loads(r.stdout)}
    assert rows["osfarm/desktop:latest"]["kind"] == "desktop" and rows["osfarm/base:bookworm"]["kind"] == "base"
    assert "<none>" not in rows, "dangling images are hidden unless --all"


def test_manifest_lists_debian_and_python_packages(built: str) -> None:
    r = run_in("osfarm/desktop:latest", "cat /etc/osfarm/manifest.txt")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for pkg in ("chromium=", "libreoffice-calc=", "gimp=", "vlc=", "thunderbird=", "xvfb=", "redis-server="):
        assert f"\n{pkg}" in text, pkg
    assert f"\nosfarm=={__version__}\n" in text
    assert "\npyautogui==" in text.lower()


def test_desktop_image_looks_like_osworlds_vm(built: str) -> None:
    script = (
        "set -e; id -un; id -u; echo $HOME; "
        "echo password | sudo -S -k true 2>/dev/null && echo sudo-ok; "
        "python -c 'import importlib.util as u; print(all(u.find_spec(m) for m in (\"pyautogui\", \"pyatspi\")))'; "
        "python3 --version; command -v google-chrome; command -v chromium; command -v soffice; command -v gimp; "
        "command -v vlc; command -v thunderbird; command -v xfce4-terminal; command -v Xvfb; "
        "osfarm --help >/dev/null && echo cli-ok; "
        # OSWorld's VM (issue 19): Files, Videos, Document Viewer; the agent's Python is the system one
        # with pyautogui and without osfarm (osfarm's own is /opt/osfarm/bin/python); Ubuntu's user dirs
        "command -v nautilus; command -v totem; command -v evince; readlink /usr/local/bin/python; "
        "/usr/bin/python3 -c 'import importlib.util as u; print(\"agent-python\", bool(u.find_spec(\"pyautogui\")), "
        "bool(u.find_spec(\"osfarm\")))'; echo home: $(ls /usr/share/osfarm/home-template)"
    )
    r = run_in("osfarm/desktop:latest", script)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[:3] == ["user", "1000", "/home/user"], lines
    assert "sudo-ok" in lines and "True" in lines and "cli-ok" in lines, lines
    assert "/usr/local/bin/google-chrome" in lines, lines
    assert {"/usr/bin/nautilus", "/usr/bin/totem", "/usr/bin/evince", "/usr/bin/python3"} <= set(lines), lines
    assert "agent-python True False" in lines, lines
    assert "home: Desktop Documents Downloads Music Pictures Public Templates Videos" in lines, lines


@pytest.mark.skipif(os.geteuid() != 0, reason="the debootstrap base needs root")
def test_base_is_plain_debian(built: str) -> None:
    r = run_in(recipes.BASE_IMAGE, "cat /etc/debian_version; dpkg-query -W -f '${Package}\\n' | wc -l; "
                                   "ls /usr/share/doc | head -1; test -e /etc/dpkg/dpkg.cfg.d/90osfarm && echo cfg")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split()
    assert lines[0].startswith("12."), lines
    assert int(lines[1]) < 200, "minbase, not a full system"
    assert "cfg" in lines


def test_missing_base_image_says_how_to_get_it() -> None:
    docker_or_skip()
    r = subprocess.run([*OSFARM, "image", "build", "--base", "osfarm-test/nosuch:1", "--only", "runtime"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--base osfarm-test/nosuch:1" in r.stderr and "docker pull" in r.stderr and "Traceback" not in r.stderr
