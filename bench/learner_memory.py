"""Peak host memory of one learner update at batch 8 and batch 64, and update time with saves on/off.

Each batch size runs in a child process of its own (the tiny Qwen2-VL model, ``micro_batch_size``
samples per forward pass): episodes of ``--steps`` steps whose prompts carry the last
``--images`` 1920x1080 screenshots (stored as PNG files, as a run's blob store keeps them), one
sample per step. After a warm-up update (lazy allocations, AdamW's moments) the child resets its
RSS high-water mark (``/proc/self/clear_refs``: 5), runs one update and reads ``VmHWM``: the
figure is that peak minus the RSS just before the update (what the update itself added: encoded
``pixel_values``, activations, gradients). Host memory only, measured by the kernel; the tiny
model runs on the CPU, so torch's tensors are all in it.

The learner encodes a micro-batch's samples when that micro-batch runs (both passes) and frees
them after, so the figure should not grow with the batch: the script exits 1 when batch 64's is
over ``--ratio`` (1.25) times batch 8's.

Saves: ``--updates`` updates timed with no save, then with ``Learner.save`` after each (served
weights every update for the weight sync, a full checkpoint every ``--checkpoint-every``, written
in the background).

    python bench/learner_memory.py [--batches 8,64] [--steps 3] [--images 2] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _proc_kib(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(m.group(1))


def _screenshots(folder: Path, count: int) -> list[Path]:
    """Distinct 1080p desktop-like screenshots (windows, text lines) as PNG files."""
    from PIL import Image, ImageDraw

    out = []
    for i in range(count):
        img = Image.new("RGB", (1920, 1080), (30 + 7 * i % 200, 90, 160))
        draw = ImageDraw.Draw(img)
        for w in range(6):
            x, y = 80 + 230 * w + 11 * i % 90, 60 + 140 * w
            draw.rectangle((x, y, x + 700, y + 420), fill=(235, 235, 235), outline=(20, 20, 20), width=3)
            for line in range(12):
                draw.text((x + 20, y + 30 + 30 * line), f"window {w} line {line} shot {i}", fill=(10, 10, 10))
        path = folder / f"shot{i}.png"
        img.save(path, "PNG")
        out.append(path)
    return out


def _samples(shots: list[Path], episodes: int, steps: int, images: int) -> list:
    from osfarm.trainer.samples import Sample

    out = []
    for e in range(episodes):
        for s in range(steps):
            content: list[dict] = [{"type": "text", "text": f"Episode {e} step {s}: close the dialog."}]
            for k in range(max(0, s + 1 - images), s + 1):  # the last `images` screenshots of the episode
                shot = shots[(e * steps + k) % len(shots)]
                content.append({"type": "image_url", "image_url": {"url": str(shot)}})
            msgs = [{"role": "system", "content": "You control a Linux desktop."}, {"role": "user", "content": content}]
            out.append(Sample(messages=msgs, response_token_ids=[100 + (e * 7 + s * 3 + t) % 500 for t in range(12)],
                              behav_logprobs=None, policy_version=0, advantage=1.0 if e % 2 else -1.0,
                              reward=float(e % 2), task_id="t", group_id=f"g{e // 8}", episode_id=f"e{e}",
                              step_index=s + 1))
    return out


def child(args: argparse.Namespace) -> None:
    import torch

    from osfarm.policy.tiny import tiny_model_dir
    from osfarm.trainer.learner import Learner, LearnerOptions

    torch.manual_seed(0)
    shots = sorted(Path(args.shots).glob("shot*.png"))
    learner = Learner(tiny_model_dir(), LearnerOptions(lr=1e-4, micro_batch_size=args.micro_batch))
    samples = _samples(shots, args.batch, args.steps, args.images)
    learner.update(samples[:args.micro_batch])  # warm-up: optimizer state, lazy allocations
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current RSS
    before = _proc_kib("VmRSS")
    t0 = time.perf_counter()
    learner.update(samples)
    update_s = time.perf_counter() - t0
    peak = _proc_kib("VmHWM")
    result = {"batch": args.batch, "samples": len(samples), "rss_before_mib": before / 1024,
              "peak_mib": peak / 1024, "update_peak_mib": (peak - before) / 1024, "update_s": update_s}
    if args.save_timing:
        result.update(_save_timing(learner, samples[:args.micro_batch * 2], args))
    Path(args.out).write_text(json.dumps(result))


def _save_timing(learner, samples: list, args: argparse.Namespace) -> dict[str, float]:
    """Seconds per update (the update and what it waits for of its save): no save; the loop's
    saves (weights every version, a full checkpoint every ``--checkpoint-every`` snapshotted and
    written in the background: in a run that write overlaps the next update, here it is waited
    for outside the timing); a full checkpoint every version, written before the next update.
    Interleaved round by round, so a busy machine's load weighs on the three alike."""
    kinds = ("update_s_saves_on", "update_s_full_sync_save_every_update", "update_s_saves_off")
    spent = dict.fromkeys(kinds, 0.0)
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.updates):
            for kind in kinds:
                if kind != "update_s_saves_on":
                    learner.wait_saved()  # a background write of this round is charged to no other kind
                t0 = time.perf_counter()
                learner.update(samples)
                out = Path(d) / f"v{learner.version}"
                if kind == "update_s_saves_on":  # the loop's cadence, counted in its own updates
                    learner.save(out, full=(r + 1) % args.checkpoint_every == 0, background=True)
                elif kind == "update_s_full_sync_save_every_update":
                    learner.save(out)
                spent[kind] += time.perf_counter() - t0
        learner.wait_saved()
    return {k: v / args.updates for k, v in spent.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,64", help="episodes per update, compared side by side")
    ap.add_argument("--steps", type=int, default=3, help="steps (samples) per episode")
    ap.add_argument("--images", type=int, default=2, help="screenshots in each step's prompt (the last N)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=1.25, help="fail when the largest batch's peak is over this "
                    "times the smallest's")
    ap.add_argument("--updates", type=int, default=4, help="updates timed with saves off and on")
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--no-save-timing", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--shots", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save-timing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        _screenshots(Path(d), 12)
        for i, batch in enumerate(batches):
            out = Path(d) / f"b{batch}.json"
            cmd = [sys.executable, __file__, "--child", "--batch", str(batch), "--shots", d, "--out", str(out),
                   "--steps", str(args.steps), "--images", str(args.images), "--micro-batch", str(args.micro_batch),
                   "--updates", str(args.updates), "--checkpoint-every", str(args.checkpoint_every)]
            if i == 0 and not args.no_save_timing:
                cmd.append("--save-timing")
            subprocess.run(cmd, check=True)
            rows.append(json.loads(out.read_text()))
    print(f"{'batch':>6} {'samples':>8} {'rss before MiB':>15} {'update peak MiB':>16} {'update s':>9}")
    for r in rows:
        print(f"{r['batch']:>6} {r['samples']:>8} {r['rss_before_mib']:>15.0f} {r['update_peak_mib']:>16.1f} "
              f"{r['update_s']:>9.1f}")
    timing = rows[0]
    if "update_s_saves_off" in timing:
        print(f"batch {timing['batch']} x{args.updates} updates, s/update: saves off {timing['update_s_saves_off']:.2f}"
              f", saves on (weights every update, full checkpoint every {args.checkpoint_every}, background) "
              f"{timing['update_s_saves_on']:.2f}, full checkpoint every update waited for "
              f"{timing['update_s_full_sync_save_every_update']:.2f}")
    print(json.dumps(rows))
    small, large = rows[0]["update_peak_mib"], rows[-1]["update_peak_mib"]
    if large > args.ratio * small:
        print(f"FAIL: batch {rows[-1]['batch']}'s update peak {large:.1f} MiB is over {args.ratio} x batch "
              f"{rows[0]['batch']}'s {small:.1f} MiB: memory grows with the batch")
        return 1
    print(f"ok: batch {rows[-1]['batch']}'s update peak is {large / small:.2f} x batch {rows[0]['batch']}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
