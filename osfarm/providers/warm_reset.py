"""Warm resets, provider side: the policy every provider with a warm reset shares (sandbox, docker).

With ``reset_mode: warm`` a provider calls :meth:`WarmResets.after_cold_start` once a new box is
ready (the guest records its baseline, ``/v1/session/baseline``) and :meth:`WarmResets.reset` to
reset it: the guest puts the box back (``/v1/session/warm_reset``, :mod:`osfarm.desktop.warm.warm`)
with a new token, and the reset is kept only when the new fingerprint's digest equals the
baseline's. Otherwise (a mismatch, an error, no answer within ``warm_reset_timeout_s``, every
``cold_every`` resets, or a box that is not alive) the provider's cold reset runs, and the new
handle says why (``info["reset_fallback"]``, ``info["reset_fallback_kind"]``: mismatch, error,
timeout, every_n, or dead: the box was not alive, so no warm reset was tried; the pool counts
them). The baseline's digest is also kept in the handle (``info["warm_digest"]``), so a farm that
takes over a running box after a restart (:meth:`WarmResets.adopted`) can still
reset it warm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from osfarm.config import FarmSettings
from osfarm.desktop.warm.fingerprint_diff import differences
from osfarm.providers.base import DesktopHandle, GuestEndpoint, ProviderError
from osfarm.providers.boxes import discarded_on_failure

log = logging.getLogger("osfarm.providers.warm_reset")

DIGEST_INFO = "warm_digest"


class WarmResetFailed(ProviderError):
    """A warm reset did not give a desktop provably like a cold start; ``kind``: mismatch, error."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


async def guest_post(endpoint: GuestEndpoint, path: str, body: dict | None, timeout: float) -> dict:
    async with endpoint.client(timeout=timeout) as c:
        r = await c.post(path, json=body)
    if r.status_code != 200:
        raise WarmResetFailed(f"{path}: {r.status_code} {r.text[:500]}", "error")
    return r.json()


class WarmResets:
    """Per desktop: the fingerprint of its cold start and how many warm resets it had since."""

    def __init__(self, settings: FarmSettings):
        self.settings = settings
        self._baselines: dict[str, dict] = {}  # desktop id -> fingerprint of its cold start
        self._counts: dict[str, int] = {}  # desktop id -> warm resets since its cold start

    @property
    def enabled(self) -> bool:
        return self.settings.reset_mode == "warm"

    async def after_cold_start(self, handle: DesktopHandle, discard: Callable[[], Awaitable[None]]) -> None:
        """A new box is ready: with warm resets on, the guest records the state to go back to
        (a failure discards the box, like a failed start)."""
        self.forget(handle.id)
        self._counts[handle.id] = 0
        if not self.enabled:
            return
        async with discarded_on_failure(handle.id, discard):
            fp = await guest_post(handle.endpoint, "/v1/session/baseline", None, self.settings.start_timeout_s)
        self._baselines[handle.id] = fp
        handle.info[DIGEST_INFO] = str(fp.get("digest", ""))

    def adopted(self, handle: DesktopHandle) -> None:
        """A box taken over from an earlier farm: its guest kept its baseline, the handle its digest."""
        digest = handle.info.get(DIGEST_INFO)
        if self.enabled and digest:
            self._baselines[handle.id] = {"digest": digest}
            self._counts[handle.id] = 0

    def forget(self, desktop_id: str) -> None:
        self._baselines.pop(desktop_id, None)
        self._counts.pop(desktop_id, None)

    async def _warm(self, handle: DesktopHandle) -> DesktopHandle:
        token = secrets.token_urlsafe(24)
        fp = await guest_post(handle.endpoint, "/v1/session/warm_reset", {"token": token},
                              self.settings.warm_reset_timeout_s)
        base = self._baselines.get(handle.id) or {}
        if fp.get("digest") != base.get("digest"):
            raise WarmResetFailed(f"the fingerprint differs from the cold start's: {'; '.join(differences(base, fp))}",
                                  "mismatch")
        endpoint = dataclasses.replace(handle.endpoint, token=token)
        info = {k: v for k, v in handle.info.items() if not k.startswith("reset_")}
        steps = ",".join(f"{k}={v:g}" for k, v in (fp.get("timings_ms") or {}).items())
        return dataclasses.replace(handle, endpoint=endpoint, info={**info, "reset_mode": "warm", "warm_ms": steps})

    async def reset(self, handle: DesktopHandle, problem: str | None,
                    cold: Callable[[DesktopHandle], Awaitable[DesktopHandle]]) -> DesktopHandle:
        """A warm reset of ``handle`` where warm resets are on and it has a baseline, else (or
        where it fails) ``cold(handle)``, the provider's kill and restart. ``problem``: what the
        provider's ``alive`` says is wrong with the box (None: it looks alive); a dead box (its X
        server or session gone, a limit hit, its container exited) is restarted cold at once, never
        sent a warm reset that would only wait for its deadline (fallback kind ``dead``)."""
        fallback = kind = ""
        if self.enabled and handle.id in self._baselines:
            every = self.settings.cold_every
            if problem is not None:
                fallback, kind = f"the box is not alive: {problem}", "dead"
                log.warning("dead box restarted cold, no warm reset tried id=%s: %s", handle.id, problem[:300])
            elif every and self._counts.get(handle.id, 0) + 1 >= every:
                fallback, kind = f"every {every} resets: a cold one", "every_n"
            else:
                t0 = time.monotonic()
                try:
                    new = await asyncio.wait_for(self._warm(handle), self.settings.warm_reset_timeout_s)
                    self._counts[handle.id] = self._counts.get(handle.id, 0) + 1
                    new.info["reset_s"] = f"{time.monotonic() - t0:.3f}"
                    return new
                except TimeoutError:
                    fallback, kind = f"no answer within {self.settings.warm_reset_timeout_s:g} s", "timeout"
                except WarmResetFailed as e:
                    fallback, kind = str(e), e.kind
                except Exception as e:  # noqa: BLE001 - whatever failed, a cold restart is the answer
                    fallback, kind = f"{type(e).__name__}: {e}", "error"
                log.warning("warm reset fell back to cold id=%s kind=%s: %s", handle.id, kind, fallback[:300])
        new = await cold(handle)
        new.info["reset_mode"] = "cold"
        if fallback:
            new.info["reset_fallback"] = fallback[:500]
            new.info["reset_fallback_kind"] = kind
        return new
