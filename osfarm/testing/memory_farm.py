"""A farm process over ``osfarm.testing.memory_provider`` boxes: the whole farm (API, auth, pool, leases,
registry, guest links) with boxes that are tiny in-process HTTP servers, so thousands of
lease/observe/release cycles need no desktop. For load and leak measurements (bench/load.py,
tests/chaos). Runs until SIGTERM/SIGINT::

    python -m osfarm.testing.memory_farm --port 8765 --token T --state-dir /tmp/x [--pool-min 4 --pool-max 600]
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from osfarm.config import FarmSettings
from osfarm.farm.server import FarmServer
from osfarm.testing.memory_provider import MemoryProvider


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--pool-min", type=int, default=2)
    ap.add_argument("--pool-max", type=int, default=4)
    ap.add_argument("--lease-ttl-s", type=float, default=60.0)
    a = ap.parse_args()
    settings = FarmSettings(port=a.port, token=a.token, state_dir=Path(a.state_dir), pool_min=a.pool_min,
                            pool_max=a.pool_max, width=1024, height=768, lease_ttl_s=a.lease_ttl_s)
    server = FarmServer(settings, MemoryProvider(), port=a.port, log_level="warning")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start(timeout=60)
    print(f"memory farm on {server.url}", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
