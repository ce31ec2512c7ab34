"""The docs say what is true of this repository: every link and file path in README.md and docs/
leads to a file of the checkout (nothing outside it, such as ``../shared`` or an absolute path),
and the README's cluster commands resolve as written (the secrets its ``export`` line sets are
the ones compose.yaml requires)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A file of the repository named in backquotes: `osfarm/farm/api.py`, `tests/test_layers.py`, ...
REPO_PATH = re.compile(r"`((?:osfarm|tests|bench|scripts|suites|docs)/[\w./-]+\.(?:py|md|yaml|yml|sh|txt|json|toml))`")
OUTSIDE = re.compile(r"\.\./shared|/work/")


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as '-'."""
    heads = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
    return {re.sub(r"[^\w -]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def link_problems(page: Path) -> list[str]:
    text = page.read_text()
    problems = [f"points outside the repository: {m.group(0)!r}" for m in OUTSIDE.finditer(text)]
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # https://, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if path and (not dest.is_relative_to(ROOT) or not dest.exists()):
            problems.append(f"link to a missing file: {target}")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            problems.append(f"link to a missing heading: {target}")
    problems += [f"names a missing file: {m.group(1)}" for m in REPO_PATH.finditer(text)
                 if not (ROOT / m.group(1)).exists()]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_links_and_paths_stay_in_the_repository(page: Path) -> None:
    assert link_problems(page) == []


def test_the_link_check_finds_what_is_wrong(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](#top) [gone](nope.md) [bad anchor](#nowhere) `osfarm/no_such.py` "
                    "the tasks in `../shared/osworld` [mail](mailto:x@example.org)\n")
    got = link_problems(page)
    assert got == ["points outside the repository: '../shared'", "link to a missing file: nope.md",
                   "link to a missing heading: #nowhere", "names a missing file: osfarm/no_such.py"]


@pytest.mark.desktop  # runs the docker CLI (compose's own interpolation; no daemon needed, nothing starts)
def test_the_readme_cluster_commands_resolve_as_written(tmp_path: Path) -> None:
    """The README's ``export`` line, then its ``docker compose ... up -d`` as ``config``: compose
    accepts the environment a newcomer who copies the block has; without that line it refuses,
    naming the secret (so the line is what makes the command work)."""
    if shutil.which("docker") is None or subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                         check=False).returncode != 0:
        pytest.skip("no docker compose (bash scripts/setup-docker.sh)")
    block = re.search(r"## A cluster.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md: no bash block under '## A cluster'"
    lines = block.group(1).splitlines()
    export = next(line for line in lines if line.startswith("export "))
    up = next(line for line in lines if line.startswith("docker compose ") and " up" in line)
    config = up[: up.index(" up")] + " config --quiet"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OSFARM_")}
    ok = subprocess.run(["bash", "-c", f"{export}\n{config}"], env=clean, cwd=ROOT, capture_output=True, text=True,
                        timeout=60, check=False)
    assert ok.returncode == 0, f"{export}\n{config}\n{ok.stderr}"
    bare = subprocess.run(["bash", "-c", config], env=clean, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert bare.returncode != 0 and "OSFARM_" in bare.stderr, bare.stderr
