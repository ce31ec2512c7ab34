#!/usr/bin/env python3
"""Build the osfarm-offline suite: every input and gold file under cache/<task_id>/, every task
JSON with its reference solution under <domain>/, and test_all.json.

Each module in domains/ builds its own tasks (see suitekit.py).  Nothing is downloaded.
    python build_suite.py            # (re)write the suite
    python build_suite.py --check    # exit 1 when the committed files differ from a fresh build
"""
from __future__ import annotations

import filecmp
import importlib.util
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from suitekit import SuiteKit  # noqa: E402

GENERATED = ["cache", "test_all.json"]


def domain_modules() -> list[Path]:
    return sorted(p for p in (HERE / "domains").glob("*.py") if not p.name.startswith("_"))


def build(root: Path) -> SuiteKit:
    kit = SuiteKit(root)
    for path in domain_modules():
        spec = importlib.util.spec_from_file_location(f"osfarm_offline_{path.stem}", path)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build(kit)
    kit.write()
    return kit


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        kit = build(Path(tmp))
        stale = []
        for path in kit.files:
            rel = path.relative_to(tmp)
            if not (HERE / rel).exists() or (HERE / rel).read_bytes() != path.read_bytes():
                stale.append(str(rel))
        for p in (Path(tmp) / "cache").rglob("*"):
            rel = p.relative_to(tmp)
            if p.is_file() and not (HERE / rel).exists():
                stale.append(str(rel))
        if not filecmp.cmp(Path(tmp) / "test_all.json", HERE / "test_all.json", shallow=False):
            stale.append("test_all.json")
    if stale:
        print("suite files differ from a fresh build (run build_suite.py):", *stale[:20], sep="\n  ")
        return 1
    print("suite is up to date")
    return 0


def rebuild() -> SuiteKit:
    """Build into a scratch folder first, so a domain module that fails leaves the suite intact;
    then overwrite in place and drop only stale files (a run reading the suite meanwhile never
    sees a task without its files)."""
    build(Path(tempfile.mkdtemp(prefix="suite-build-")))
    kit = build(HERE)
    keep = set(kit.files) | {p for p in (HERE / "cache").rglob("*") if p in kit.assets}
    for d in [HERE / "cache"] + [d for d in HERE.iterdir() if d.is_dir() and (d / "solutions").is_dir()]:
        for p in sorted(d.rglob("*"), reverse=True):
            if p.is_file() and p not in keep:
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
    return kit


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(check())
    kit = rebuild()
    print({k: len(v) for k, v in kit.index.items()})
