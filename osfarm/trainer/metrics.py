"""Training metrics: one row per policy update, to a JSONL log, the console, Prometheus,
TensorBoard, W&B and a plot.

Rows go to ``<run>/metrics.jsonl`` (appended, so a resumed run continues the same log); the
Prometheus gauges live on a private registry, served at ``/metrics`` when a port is given and
always written to ``<run>/metrics.prom`` (node-exporter's textfile format); TensorBoard event
files go to ``<run>/tensorboard/`` (``train/<key>`` and ``eval/<key>`` scalars against the policy
version: ``tensorboard --logdir <run>/tensorboard``); W&B gets the same when the ``wandb`` package
is installed and a project is configured (``metrics.wandb.project`` or ``WANDB_PROJECT``), in the
mode configured or ``WANDB_MODE`` says (``offline`` writes under ``<run>/wandb`` and sends
nothing); ``plot()`` draws the curves of the whole log into ``<run>/curves.png`` (matplotlib, Agg
backend: no display needed), the held-out evaluation's success next to the training reward.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server, write_to_textfile
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from osfarm.trainer.evaluation import read_eval_rows


class WandbOptions(BaseModel):
    """W&B logging; used when ``wandb`` is installed and a project is set (here or ``WANDB_PROJECT``)."""

    model_config = ConfigDict(extra="forbid")
    project: str | None = None
    entity: str | None = None
    name: str | None = Field(default=None, description="run name (default: the run dir's name)")
    mode: str | None = Field(default=None, pattern="^(online|offline|disabled)$",
                             description="default: WANDB_MODE, else wandb's own default")

# The curves drawn, in order; a key missing from the log is skipped. The held-out evaluation's
# success rate (eval.jsonl) is drawn in the panels of these keys too.
PLOTTED = ("reward", "success_rate", "staleness_max", "loss", "kl", "entropy", "episodes_per_s", "samples_per_s")
EVAL_NEXT_TO = ("reward", "success_rate")
# Keys shown in the one-line console summary of an update.
# a queued run's row: rollouts_worker_<name> is the episodes worker <name> ran
WORKER_PREFIX = "rollouts_worker_"
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32)
CONSOLE = ("version", "reward", "success_rate", "staleness_max", "loss", "kl", "entropy", "episodes_per_s")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _numbers(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "time"}


class TrainMetrics:
    def __init__(self, run_dir: Path, console: Console | None = None, prometheus_port: int | None = None, *,
                 tensorboard: bool = True, wandb: WandbOptions | None = None, config: Mapping[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.console = console or Console(stderr=True)
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges: dict[str, Gauge] = {}
        # a cluster run's figures as labelled series and a distribution, next to the per-key gauges
        self.worker_rollouts = Gauge("osfarm_train_worker_rollouts", "trainer: episodes each queue worker ran "
                                     "(records taken from the stream, this process)", ["worker"],
                                     registry=self.registry)
        self.staleness = Histogram("osfarm_train_sample_staleness", "trainer: versions between a trained "
                                   "sample's policy and the learner's, per sample", buckets=STALENESS_BUCKETS,
                                   registry=self.registry)
        self.server: Any = None
        self.port: int | None = None
        if prometheus_port is not None:
            self.server, _thread = start_http_server(prometheus_port, addr="127.0.0.1", registry=self.registry)
            self.port = self.server.server_port
        self.tb: Any = None
        if tensorboard:
            self.tb = self._open_tensorboard()
        self.wandb: Any = self._open_wandb(wandb or WandbOptions(), config or {})

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # the train extra brings tensorboard; without it, say so once
            self.console.print(f"[yellow]TensorBoard logging off[/]: {e} (pip install tensorboard)", highlight=False)
            return None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def _open_wandb(self, opts: WandbOptions, config: Mapping[str, Any]) -> Any:
        project = opts.project or os.environ.get("WANDB_PROJECT")
        if not project:
            return None
        try:
            import wandb
        except ImportError:
            self.console.print(f"[yellow]W&B logging off[/]: project {project!r} is configured but the wandb package "
                               "is not installed (pip install wandb)", highlight=False)
            return None
        mode = opts.mode or os.environ.get("WANDB_MODE") or None
        run = wandb.init(project=project, entity=opts.entity, name=opts.name or self.run_dir.name, mode=mode,
                         dir=str(self.run_dir), config=dict(config), resume="allow",
                         # one W&B run per run dir, so a resumed run continues it
                         id=hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16])
        run.define_metric("train/version")
        run.define_metric("train/*", step_metric="train/version")
        run.define_metric("eval/version")
        run.define_metric("eval/*", step_metric="eval/version")
        return run

    def _gauge(self, key: str) -> Gauge:
        name = "osfarm_train_" + "".join(c if c.isalnum() else "_" for c in key)
        if key not in self.gauges:
            self.gauges[key] = Gauge(name, f"trainer: {key} at the latest update", registry=self.registry)
        return self.gauges[key]

    def log(self, row: Mapping[str, Any]) -> None:
        row = {"time": time.time(), **row}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._gauge(k).set(float(v))
                if k.startswith(WORKER_PREFIX):
                    self.worker_rollouts.labels(worker=k.removeprefix(WORKER_PREFIX)).set(float(v))
        for stale, n in (row.get("staleness_hist") or {}).items():
            for _ in range(int(n)):
                self.staleness.observe(float(stale))
        write_to_textfile(str(self.run_dir / "metrics.prom"), self.registry)
        self._scalars("train", row)
        parts = []
        for k in CONSOLE:
            v = row.get(k)
            if v is not None:
                parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        self.console.print("[bold]train[/] " + " ".join(parts), highlight=False)

    def log_eval(self, row: Mapping[str, Any]) -> None:
        """A held-out evaluation result (the row is already in eval.jsonl)."""
        sr = row.get("success_rate")
        shown = f"{sr:.3f}" if isinstance(sr, float) else "n/a"
        self.console.print(f"[bold]eval[/] version={row['version']} success_rate={shown} "
                           f"episodes={row.get('episodes')} "
                           f"infra_errors={row.get('infra_errors')}", highlight=False)
        for k, v in _numbers(row).items():
            self._gauge(f"eval_{k}").set(v)
        write_to_textfile(str(self.run_dir / "metrics.prom"), self.registry)
        self._scalars("eval", row)

    def _scalars(self, prefix: str, row: Mapping[str, Any]) -> None:
        nums = _numbers(row)
        step = int(row.get("version", 0))
        if self.tb is not None:
            for k, v in nums.items():
                if k != "version":
                    self.tb.add_scalar(f"{prefix}/{k}", v, global_step=step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in nums.items()})

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.path)

    def plot(self, out: Path | None = None) -> Path | None:
        return plot_curves(self.rows(), out or self.run_dir / "curves.png",
                           eval_rows=read_eval_rows(self.run_dir / "eval.jsonl"))

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def plot_curves(rows: Sequence[Mapping[str, Any]], out: Path,
                eval_rows: Sequence[Mapping[str, Any]] = ()) -> Path | None:
    """One small panel per metric against the policy version, the held-out success rate next to
    the training reward and success; None when there is nothing to draw."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in PLOTTED if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not keys:
        return None
    cols = 3
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 2.6 * nrows), squeeze=False)
    for ax, k in zip(axes.flat, keys, strict=False):
        pts = [(r.get("version", i), r[k]) for i, r in enumerate(rows) if isinstance(r.get(k), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label="train")
        held = [(r["version"], r["success_rate"]) for r in eval_rows if isinstance(r.get("success_rate"), (int, float))]
        if k in EVAL_NEXT_TO and held:
            ax.plot([p[0] for p in held], [p[1] for p in held], marker="s", markersize=3, label="held-out success")
            ax.legend(fontsize=7)
        ax.set_title(k, fontsize=9)
        ax.set_xlabel("policy version", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
