"""Learner throughput on 1 and 2 ranks (torch.distributed, gloo, data parallel on the CPU).

The same batches (screenshot prompts of the tiny Qwen2-VL model, replies of a few tokens, GRPO
advantages) go through ``Learner.update`` under torchrun with 1 and with N ranks; each rank gets
``--threads`` torch threads (default: the machine's CPUs divided by the ranks, so both settings
use the whole machine). Samples/s = samples trained / wall seconds of the timed updates (one
warm-up update first). Each rank computes its share of every minibatch; the gradients are summed
over the ranks (an all-reduce of the whole model per optimizer step).

    python bench/learner_scaling.py [--ranks 1,2] [--samples 16] [--updates 3] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _screenshot(i: int) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (1280, 720), (20 * (i % 10), 90, 160))
    ImageDraw.Draw(img).rectangle((100 + 10 * i, 100, 400, 220), fill=(240, 240, 240))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def rank_main(args: argparse.Namespace) -> None:
    import torch

    from osfarm.policy.tiny import tiny_model_dir
    from osfarm.trainer.distributed import DistContext
    from osfarm.trainer.learner import Learner, LearnerOptions
    from osfarm.trainer.samples import Sample

    torch.set_num_threads(args.threads)
    ctx = DistContext.from_env()
    learner = Learner(tiny_model_dir(), LearnerOptions(lr=1e-4, micro_batch_size=args.micro_batch), ctx=ctx)
    samples = []
    for i in range(args.samples):
        msgs = [{"role": "system", "content": "You control a Linux desktop."},
                {"role": "user", "content": [{"type": "text", "text": f"Step {i}: click the box."},
                                             {"type": "image_url", "image_url": {"url": _screenshot(i)}}]}]
        samples.append(Sample(messages=msgs, response_token_ids=[100 + (i * 7 + t) % 500 for t in range(args.tokens)],
                              behav_logprobs=None, policy_version=0, advantage=1.0 if i % 2 else -1.0,
                              reward=float(i % 2), task_id="t", group_id="g", episode_id=f"e{i}", step_index=1))
    if not ctx.is_main:
        learner.serve_commands()
        return
    learner.update(samples)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.updates):
        learner.update(samples)
    wall = time.perf_counter() - t0
    learner.stop_workers()
    Path(args.out).write_text(json.dumps({"ranks": ctx.world, "threads": args.threads, "wall_s": wall,
                                          "samples_per_s": args.samples * args.updates / wall}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--samples", type=int, default=16, help="samples per update")
    ap.add_argument("--tokens", type=int, default=8, help="response tokens per sample")
    ap.add_argument("--updates", type=int, default=3, help="timed updates (after one warm-up)")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPUs / ranks)")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    from rich.console import Console
    from rich.table import Table

    cpus = len(os.sched_getaffinity(0))
    results = []
    with tempfile.TemporaryDirectory(prefix="osfarm-learner-bench-") as tmp:
        for n in [int(x) for x in args.ranks.split(",")]:
            threads = args.threads or max(1, cpus // n)
            out = Path(tmp) / f"r{n}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
                   "--rank-main", "--out", str(out), "--samples", str(args.samples), "--tokens", str(args.tokens),
                   "--updates", str(args.updates), "--micro-batch", str(args.micro_batch), "--threads", str(threads)]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            if r.returncode != 0:
                raise SystemExit(f"{n} rank(s) failed:\n{r.stderr[-3000:]}")
            results.append(json.loads(out.read_text()))
    base = results[0]["samples_per_s"]
    table = Table(title=f"learner samples/s (CPU, gloo): {args.samples} samples × {args.updates} updates, "
                        f"micro-batch {args.micro_batch}, {cpus} CPUs, load {os.getloadavg()[0]:.1f}")
    for col in ("ranks", "threads/rank", "samples/s", f"× {results[0]['ranks']} rank(s)", "wall s"):
        table.add_column(col, justify="right")
    for res in results:
        table.add_row(str(res["ranks"]), str(res["threads"]), f"{res['samples_per_s']:.2f}",
                      f"{res['samples_per_s'] / base:.2f}", f"{res['wall_s']:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
