"""Training metrics: one row per policy update, to a JSONL log, the console, Prometheus and a plot.

Rows go to ``<run>/metrics.jsonl`` (appended, so a resumed run continues the same log); the
Prometheus gauges live on a private registry, served at ``/metrics`` when a port is given and
always written to ``<run>/metrics.prom`` (node-exporter's textfile format); ``plot()`` draws the
curves of the whole log into ``<run>/curves.png`` (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server, write_to_textfile
from rich.console import Console

# The curves drawn, in order; a key missing from the log is skipped.
PLOTTED = ("reward", "success_rate", "staleness_max", "loss", "kl", "entropy", "episodes_per_s", "samples_per_s")
# Keys shown in the one-line console summary of an update.
CONSOLE = ("version", "reward", "success_rate", "staleness_max", "loss", "kl", "entropy", "episodes_per_s")


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TrainMetrics:
    def __init__(self, run_dir: Path, console: Console | None = None, prometheus_port: int | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.console = console or Console(stderr=True)
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges: dict[str, Gauge] = {}
        self.server: Any = None
        self.port: int | None = None
        if prometheus_port is not None:
            self.server, _thread = start_http_server(prometheus_port, addr="127.0.0.1", registry=self.registry)
            self.port = self.server.server_port

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
        write_to_textfile(str(self.run_dir / "metrics.prom"), self.registry)
        parts = []
        for k in CONSOLE:
            v = row.get(k)
            if v is not None:
                parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        self.console.print("[bold]train[/] " + " ".join(parts), highlight=False)

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.path)

    def plot(self, out: Path | None = None) -> Path | None:
        return plot_curves(self.rows(), out or self.run_dir / "curves.png")

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None


def plot_curves(rows: Sequence[Mapping[str, Any]], out: Path) -> Path | None:
    """One small panel per metric against the policy version; None when there is nothing to draw."""
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
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
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
