"""Readiness polling for tests: wait for a condition instead of sleeping a fixed time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_until(pred: Callable[[], Any], timeout: float, what: str | Callable[[], str] = "condition",
               interval: float = 0.05) -> Any:
    """Poll ``pred`` until truthy and return its value; ``what`` (or its value, if callable)
    names the condition in the failure."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


async def async_wait_until(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
                           interval: float = 0.02) -> Any:
    """Like :func:`wait_until`, without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
