"""Downloading a URL that a task file names, as safely as a hostile task file requires.

Used on the host (``osfarm tasks fetch``, ``osfarm eval --online``: the file cache) and inside a
desktop (the guest's ``/setup/download_file``). Task files are third-party input, so a download:

* fetches only ``http``/``https`` URLs, and follows a redirect only to another ``http(s)`` URL
  (a ``Location: file:///etc/passwd`` is refused), at most ``max_redirects`` times;
* with an allow-list, fetches only from the hosts on it (``example.org``, or ``.example.org`` for
  the domain and every sub-domain), checked again at every redirect;
* never reaches a loopback, private, link-local or otherwise non-global address (the farm's own
  API, a cloud metadata service, the LAN) unless its host is on the allow-list by name: a task
  must not make the harness read something only the harness can reach and hand it to the agent.
  The check runs on the addresses the host resolves to before each request; a DNS answer that
  changes between that check and the connection (rebinding) is not caught - use an allow-list
  where that matters;
* stops at ``max_bytes`` (announced or received) and at ``timeout_s`` for the whole download;
* detects a truncated body (fewer bytes than ``Content-Length``/``Content-Range`` announced) and
  keeps what arrived as ``<dest>.part``, so the next attempt resumes with a ``Range`` request
  (guarded by ``If-Range`` with the ETag or Last-Modified of the first response; without either,
  it starts over). A finished file is moved into place atomically and its SHA-256 returned.

Layer-neutral (imports nothing from osfarm): the guest server inside a desktop uses it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import ipaddress
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx

from osfarm.errors import OsfarmError

ALLOW_HOSTS_ENV = "OSFARM_DOWNLOAD_ALLOW_HOSTS"  # comma-separated default allow-list
_PART_SUFFIX = ".part"

ProgressFn = Callable[[int, int | None], None]  # (bytes so far, total or None)


class DownloadError(OsfarmError):
    """A download that failed or was refused; ``retryable`` says whether trying again may help."""

    def __init__(self, url: str, reason: str, *, retryable: bool = False):
        self.url, self.reason, self.retryable = url, reason, retryable
        super().__init__(f"{url}: {reason}")


class DownloadRefused(DownloadError):
    """The URL (or a redirect) breaks the policy: another scheme, a host off the allow-list, a
    private address, too big. Never retried."""

    def __init__(self, url: str, reason: str):
        super().__init__(url, reason, retryable=False)


def _host_matches(host: str, pattern: str) -> bool:
    pattern = pattern.strip().lower().rstrip(".")
    if pattern.startswith("."):
        return host == pattern[1:] or host.endswith(pattern)
    return host == pattern


@dataclass(frozen=True)
class DownloadPolicy:
    """What a download may do. ``allowed_hosts=None``: any host with a public address."""

    max_bytes: int = 2 << 30
    timeout_s: float = 300.0  # the whole download, redirects and retries included
    connect_timeout_s: float = 30.0
    max_redirects: int = 5
    attempts: int = 3  # tries of a retryable failure (a reset connection, a truncated body, a 5xx)
    allowed_hosts: tuple[str, ...] | None = None
    allow_private: bool = False  # reach non-global addresses of hosts not named on the allow-list

    @classmethod
    def from_env(cls, **overrides: object) -> DownloadPolicy:
        """The default policy, with ``$OSFARM_DOWNLOAD_ALLOW_HOSTS`` (comma-separated) as the
        allow-list when no ``allowed_hosts`` is given."""
        if "allowed_hosts" not in overrides:
            raw = os.environ.get(ALLOW_HOSTS_ENV, "")
            hosts = tuple(h.strip() for h in raw.split(",") if h.strip())
            overrides["allowed_hosts"] = hosts or None
        return cls(**overrides)  # type: ignore[arg-type]

    def named(self, host: str) -> bool:
        """``host`` is on the allow-list by name (which also lets it resolve to any address)."""
        return self.allowed_hosts is not None and any(_host_matches(host, p) for p in self.allowed_hosts)


@dataclass
class Downloaded:
    path: Path
    size: int
    sha256: str
    final_url: str
    resumed_from: int = 0  # bytes of an earlier partial download that were kept
    redirects: list[str] = field(default_factory=list)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


async def check_url(url: str, policy: DownloadPolicy) -> None:
    """Raise :class:`DownloadRefused` unless ``url`` may be fetched under ``policy``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise DownloadRefused(url, f"not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise DownloadRefused(url, f"only http and https URLs are downloaded, not {parts.scheme or 'a bare path'!r}")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise DownloadRefused(url, "the URL names no host")
    if parts.username or parts.password:
        raise DownloadRefused(url, "URLs with credentials are not downloaded")
    if policy.allowed_hosts is not None and not policy.named(host):
        raise DownloadRefused(url, f"host {host} is not on the allow-list ({', '.join(policy.allowed_hosts)})")
    if policy.named(host) or policy.allow_private:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            host, port or (443 if parts.scheme == "https" else 80), type=socket.SOCK_STREAM)
    except OSError as e:
        raise DownloadError(url, f"cannot resolve {host}: {e}", retryable=True) from None
    for info in infos:
        ip = info[4][0]
        if not isinstance(ip, str):  # AF_INET/AF_INET6 give text; anything else is no public address
            raise DownloadRefused(url, f"host {host} resolves to a non-IP address {ip!r}")
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
        if not addr.is_global:
            raise DownloadRefused(url, f"host {host} resolves to the non-public address {addr}; name it on the "
                                       f"allow-list to download from it")


@contextlib.asynccontextmanager
async def _dest_lock(dest: Path) -> AsyncIterator[None]:
    """One download per destination at a time, across threads and processes (flock)."""
    fd = os.open(dest.with_name(dest.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                await asyncio.sleep(0.05)  # polling keeps the wait cancellable
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _read_meta(meta: Path) -> dict[str, str]:
    try:
        data = json.loads(meta.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _content_range(value: str | None) -> tuple[int, int | None] | None:
    """``bytes START-END/TOTAL`` -> (start, total or None)."""
    if not value or not value.startswith("bytes "):
        return None
    try:
        span, _, total = value[6:].partition("/")
        start = int(span.split("-", 1)[0])
        return start, (int(total) if total.strip() not in ("", "*") else None)
    except ValueError:
        return None


async def _attempt(client: httpx.AsyncClient, url: str, dest: Path, policy: DownloadPolicy,
                   progress: ProgressFn | None, redirects: list[str]) -> tuple[str, int]:
    """One try: (final URL, bytes kept from an earlier part). Leaves ``<dest>.part`` complete."""
    part = dest.with_name(dest.name + _PART_SUFFIX)
    meta = dest.with_name(dest.name + _PART_SUFFIX + ".json")
    have = part.stat().st_size if part.exists() else 0
    saved = _read_meta(meta) if have else {}
    validator = saved.get("etag") or saved.get("last_modified")
    resume = have > 0 and saved.get("url") == url and bool(validator)
    if not resume and have:
        part.unlink()
        have = 0
    current = url
    for hop in range(policy.max_redirects + 1):
        await check_url(current, policy)
        headers = {"Accept-Encoding": "identity"}  # the bytes as stored: lengths and ranges mean bytes
        if resume:
            headers["Range"] = f"bytes={have}-"
            headers["If-Range"] = validator or ""
        async with client.stream("GET", current, headers=headers, follow_redirects=False) as r:
            if r.is_redirect:
                location = r.headers.get("location")
                if not location:
                    raise DownloadError(current, f"HTTP {r.status_code} redirect without a Location")
                target = urljoin(current, location)
                if hop == policy.max_redirects:
                    raise DownloadRefused(url, f"more than {policy.max_redirects} redirects")
                redirects.append(target)
                current = target
                continue
            if r.status_code == 416 and resume:  # the part is no prefix of what is served now
                part.unlink(missing_ok=True)
                raise DownloadError(current, "the server refused the resume range; starting over", retryable=True)
            if r.status_code not in (200, 206):
                retry = r.status_code >= 500 or r.status_code in (408, 429)
                raise DownloadError(current, f"HTTP {r.status_code}", retryable=retry)
            start, total = 0, None
            # A server that compresses anyway: store the decoded bytes (what OSWorld's requests
            # stores); lengths then count encoded bytes, so neither the size check nor a resume can
            # use them.
            encoded = r.headers.get("content-encoding", "identity").lower() not in ("", "identity")
            if r.status_code == 206:
                rng = _content_range(r.headers.get("content-range"))
                if not resume or rng is None or rng[0] != have:
                    part.unlink(missing_ok=True)
                    raise DownloadError(current, "unexpected partial content; starting over", retryable=True)
                start, total = rng
            else:
                length = r.headers.get("content-length")
                total = int(length) if length and length.isdigit() and not encoded else None
            if total is not None and total > policy.max_bytes:
                raise DownloadRefused(url, f"is {total} bytes, over the {policy.max_bytes}-byte limit")
            mode = "ab" if start else "wb"
            if not start:
                resumable = not encoded
                meta.write_text(json.dumps({"url": url, "etag": r.headers.get("etag") if resumable else None,
                                            "last_modified": r.headers.get("last-modified") if resumable else None}))
            got = start
            chunks = r.aiter_bytes() if encoded else r.aiter_raw()  # as they arrive: nothing buffered is lost on a cut
            try:
                with open(part, mode) as f:
                    async for chunk in chunks:
                        got += len(chunk)
                        if got > policy.max_bytes:
                            f.close()
                            part.unlink(missing_ok=True)
                            raise DownloadRefused(url, f"is over the {policy.max_bytes}-byte limit")
                        f.write(chunk)
                        if progress is not None:
                            progress(got, total)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout) as e:
                raise DownloadError(current, f"connection lost after {got} of {total if total is not None else '?'} "
                                             f"bytes ({type(e).__name__}); the part is kept to resume",
                                    retryable=True) from None
            if total is not None and got != total:
                raise DownloadError(current, f"truncated: got {got} of {total} bytes; the part is kept to resume",
                                    retryable=True)
            return current, start
    raise DownloadRefused(url, f"more than {policy.max_redirects} redirects")  # pragma: no cover


async def download(url: str, dest: str | os.PathLike[str], policy: DownloadPolicy | None = None, *,
                   client: httpx.AsyncClient | None = None, progress: ProgressFn | None = None,
                   lock: bool = True) -> Downloaded:
    """Download ``url`` to ``dest`` under ``policy`` (retrying, resuming), atomically.

    Raises :class:`DownloadRefused` for what the policy forbids and :class:`DownloadError` when
    every attempt failed (the last reason); a partial file stays as ``<dest>.part``. ``lock``:
    hold ``<dest>.lock`` so that threads and processes sharing a cache download a file once.
    """
    policy = policy or DownloadPolicy()
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    await check_url(url, policy)
    own = client is None
    if client is None:
        client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=policy.connect_timeout_s))
    redirects: list[str] = []
    deadline = time.monotonic() + policy.timeout_s
    try:
        async with _dest_lock(dest) if lock else contextlib.nullcontext():
            last: DownloadError | None = None
            for attempt in range(1, max(1, policy.attempts) + 1):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    async with asyncio.timeout(left):
                        final, resumed = await _attempt(client, url, dest, policy, progress, redirects)
                except TimeoutError:
                    last = DownloadError(url, f"did not finish within {policy.timeout_s:g} s", retryable=False)
                    break
                except httpx.HTTPError as e:  # connect errors, protocol errors before the body
                    last = DownloadError(url, f"{type(e).__name__}: {e}", retryable=True)
                except DownloadError as e:
                    if not e.retryable:
                        raise
                    last = e
                else:
                    part = dest.with_name(dest.name + _PART_SUFFIX)
                    digest = await asyncio.to_thread(file_sha256, part)
                    os.replace(part, dest)
                    dest.with_name(dest.name + _PART_SUFFIX + ".json").unlink(missing_ok=True)
                    return Downloaded(dest, dest.stat().st_size, digest, final, resumed, redirects)
                if attempt < policy.attempts:
                    await asyncio.sleep(min(2.0 ** (attempt - 1), max(0.0, deadline - time.monotonic())))
            if last is None:
                last = DownloadError(url, f"did not finish within {policy.timeout_s:g} s")
            raise last
    finally:
        if own:
            await client.aclose()


def download_sync(url: str, dest: str | os.PathLike[str], policy: DownloadPolicy | None = None,
                  progress: ProgressFn | None = None) -> Downloaded:
    """:func:`download` for synchronous callers (worker threads: it runs its own event loop)."""
    return asyncio.run(download(url, dest, policy, progress=progress))


__all__ = ["ALLOW_HOSTS_ENV", "DownloadError", "DownloadPolicy", "DownloadRefused", "Downloaded", "check_url",
           "download", "download_sync", "file_sha256"]
