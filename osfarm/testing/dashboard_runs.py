"""Run dirs for the dashboard tests, written by hand where a test needs what osfarm eval would
never write (hostile text, symlinks): results.json, episodes.jsonl, blobs, per-task folders."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path
from typing import Any

XSS = '<script>alert("x")</script><img src=x onerror=alert(1)>'
CLICK = {"action_type": "CLICK", "parameters": {"x": 10, "y": 20}}
PNG_1x1 = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082"
)


def _png(width: int, height: int) -> bytes:
    """A small real PNG of width x height."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    raw = b"".join(b"\x00" + b"\x00\x00\x00" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _blob(run: Path, data: bytes, ext: str, media: str) -> dict[str, Any]:
    sha = hashlib.sha256(data).hexdigest()
    rel = f"blobs/{sha[:2]}/{sha}.{ext}"
    (run / rel).parent.mkdir(parents=True, exist_ok=True)
    (run / rel).write_bytes(data)
    return {"sha256": sha, "path": rel, "media_type": media, "size": len(data)}


def make_run(run: Path, agent: str, outcomes: dict[str, tuple[str, str]], response: str = "ok",
             actions: list[Any] | None = None, started: float = 1.7e9) -> dict[str, str]:
    """A run dir as osfarm eval writes it: results.json, episodes.jsonl, blobs, per-task folders.
    ``outcomes``: task id -> (domain, status). Returns task id -> episode id."""
    run.mkdir(parents=True, exist_ok=True)
    rows, ids = [], {}
    shot = _blob(run, _png(64, 48), "png", "image/png")
    a11y = _blob(run, b"<desktop-frame>" + XSS.encode() + b"</desktop-frame>", "xml", "application/xml")
    with (run / "episodes.jsonl").open("w") as f:
        for i, (task, (domain, status)) in enumerate(outcomes.items()):
            eid = f"ep-{agent}-{i}"
            ids[task] = eid
            score = 1.0 if status == "success" else 0.0
            rows.append({"task_id": task, "domain": domain, "status": status, "score": score,
                         "error": XSS if status == "infra_error" else None, "steps": 1, "attempts": 1, "seconds": 1.5,
                         "episode_id": eid})
            step = {"index": 1, "observation": {"screenshot": shot, "a11y": a11y},
                    "model": {"request": None, "response_text": response, "response_token_ids": None,
                              "response_logprobs": None, "policy_version": None},
                    "actions": actions if actions is not None else [CLICK],
                    "action_error": None, "t_model_ms": 1.0, "t_env_ms": 2.0}
            f.write(json.dumps({"schema": "osfarm.episode/1", "episode_id": eid, "run_id": run.name, "task_id": task,
                                "domain": domain, "group_id": task, "attempt": 1, "agent": agent,
                                "policy": {"name": agent}, "desktop": {"provider": "sandbox"}, "status": status,
                                "score": 1.0 if status == "success" else 0.0, "error": None,
                                "started_at": "2026-01-01T00:00:00+00:00", "finished_at": "2026-01-01T00:00:02+00:00",
                                "steps": [step]}) + "\n")
            d = run / domain / task
            d.mkdir(parents=True, exist_ok=True)
            (d / "step_1_x.png").write_bytes(PNG_1x1)
            (d / "traj.jsonl").write_text(json.dumps({"step_num": 1, "screenshot_file": "step_1_x.png"}) + "\n")
    (run / "results.json").write_text(json.dumps({"schema": "osfarm.results/1", "run_id": run.name, "agent": agent,
                                                  "suite": "suites/demo", "started_at": started, "tasks": rows}))
    return ids
