"""A multi-turn episode trained per step vs as one sequence (data granularity ``episode``), side by side.

The tiny Qwen2-VL model on the CPU; ``--episodes`` episodes of ``--steps`` steps, each step's
prompt the whole conversation so far (system, every earlier observation and reply) with one
``--size`` screenshot per turn, the replies as the policy sampled them. The same batch is
trained twice in one run: as step samples (every step's prompt encoded and run anew: the
shared prefix computed once per step) and as episode samples (the conversation encoded once,
every reply in the loss mask). Printed: tokens through the model per update (both passes), the
update's seconds, their ratios, and the two losses (equal up to float error: the same objective).

    python bench/episode_sequence.py [--episodes 2] [--steps 5] [--size 640x360] [--micro-batch 1]
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _screenshot(i: int, size: tuple[int, int]) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (30 + 17 * i % 200, 90, 160))
    ImageDraw.Draw(img).rectangle((20 + 9 * i, 20, size[0] // 2, size[1] // 2), fill=(235, 235, 235))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _episode_steps(lrn: Any, episode: int, steps: int, size: tuple[int, int]) -> list[Any]:
    from osfarm.trainer.samples import Sample

    tok = lrn.processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    history: list[dict[str, Any]] = [{"role": "system", "content": "You control a Linux desktop."}]
    out = []
    for i in range(steps):
        reply = f"Thought: step {i} of episode {episode}.\nAction: click(start_box='({10 * i},{20 + i})')"
        prompt = [*history, {"role": "user", "content": [
            {"type": "text", "text": f"Screenshot after step {i}."},
            {"type": "image_url", "image_url": {"url": _screenshot(10 * episode + i, size)}}]}]
        out.append(Sample(messages=prompt, response_token_ids=[*tok(reply, add_special_tokens=False)["input_ids"], end],
                          behav_logprobs=None, policy_version=0, advantage=1.0 if episode % 2 else -0.5, reward=0.0,
                          task_id="t", group_id="g", episode_id=f"e{episode}", step_index=i + 1, response_text=reply))
        history = [*prompt, {"role": "assistant", "content": reply}]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=2, help="episodes in the batch")
    ap.add_argument("--steps", type=int, default=5, help="steps per episode")
    ap.add_argument("--size", default="640x360", help="screenshot size WxH")
    ap.add_argument("--micro-batch", type=int, default=1, help="learner micro_batch_size")
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    assert len(size) == 2, "--size is WxH"

    from osfarm.policy.tiny import tiny_model_dir
    from osfarm.trainer.learner import Learner, LearnerOptions
    from osfarm.trainer.samples import join_episodes

    lrn = Learner(tiny_model_dir(), LearnerOptions(lr=1e-12, micro_batch_size=args.micro_batch))
    per_step = [s for e in range(args.episodes) for s in _episode_steps(lrn, e, args.steps, (size[0], size[1]))]
    counts: dict[str, int] = {}
    episodes = join_episodes(per_step, counts)
    assert counts["episode_samples"] == args.episodes, counts
    lrn.update(per_step[:1])  # warm-up: lazy allocations, AdamW's moments
    rows = []
    for name, batch in (("per step", per_step), ("episode", episodes)):
        tokens = sum(lrn.encode(s).length for s in batch)
        t0 = time.perf_counter()
        stats = lrn.update(batch)
        rows.append((name, len(batch), tokens, time.perf_counter() - t0, stats.loss))
    print(f"{args.episodes} episodes x {args.steps} steps, one {size[0]}x{size[1]} screenshot per turn, "
          f"micro-batch {args.micro_batch} (tiny model, CPU)")
    print(f"{'mode':<10}{'samples':>8}{'tokens/pass':>13}{'update s':>10}{'loss':>12}")
    for name, n, tokens, secs, loss in rows:
        print(f"{name:<10}{n:>8}{tokens:>13}{secs:>10.2f}{loss:>12.6f}")
    (_, _, t_step, s_step, _), (_, _, t_ep, s_ep, _) = rows
    print(f"per step / episode: tokens {t_step / t_ep:.2f}x, update time {s_step / s_ep:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
