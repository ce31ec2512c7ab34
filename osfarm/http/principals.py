"""Who is calling: per-client tokens, each mapped to a :class:`Principal` (name, role, limits).

The farm knows its clients by token. Tokens are kept only as SHA-256 digests (a token file holds
digests, never tokens; a raw token given in the environment is hashed when it is read), so a
leaked token file or a memory dump does not hand out access. Tokens are high-entropy random
strings (``osfarm tokens add`` makes 32 random bytes), so a plain SHA-256 is enough: there is no
password to brute-force.

Roles (what each may do is decided by the farm's routes, see ``osfarm/farm/state.py``):

* ``admin``: everything, on every lease; ``/v1/pool`` shows every lease id. The farm's single
  ``token`` setting (``OSFARM_TOKEN``, ``--token``) is the admin token.
* ``client``: leases desktops and uses its own leases only (another client's lease answers 404,
  as if it did not exist), within ``max_leases`` leases at once and ``max_ttl_s`` per lease.
* ``viewer``: read-only: the pool's status (without lease ids), health, metrics.

Sources, merged (read by :mod:`osfarm.http.token_sources`, which the farm imports and the guest
server does not): the ``tokens_file`` setting (YAML, below), the ``tokens`` setting
(``OSFARM_TOKENS``: comma-separated ``name:role:secret[:max_leases[:max_ttl_s]]``, where
``secret`` is ``sha256:<64 hex digits>`` or a raw token) and the admin ``token``::

    # osfarm tokens file (osfarm tokens add NAME --file FILE appends to it)
    clients:
      - name: alice
        role: client          # admin | client | viewer
        sha256: 9f86d081...   # hex SHA-256 of alice's token
        max_leases: 2         # optional: most leases alice holds at once
        max_ttl_s: 3600       # optional: longest lease TTL alice may ask for
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Role = Literal["admin", "client", "viewer"]
ROLES: tuple[Role, ...] = ("admin", "client", "viewer")
ADMIN_NAME = "admin"

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. ``max_leases``/``max_ttl_s`` of None: no limit of its own (the
    pool's size and the lease TTL bounds still apply)."""

    name: str
    role: Role
    max_leases: int | None = None
    max_ttl_s: float | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def can_lease(self) -> bool:
        """May lease desktops and act on leases (its own; an admin on every lease)."""
        return self.role in ("admin", "client")

    def owns(self, lease_principal: str | None) -> bool:
        """Whether a lease held by ``lease_principal`` is visible to this caller."""
        return self.is_admin or lease_principal == self.name


def token_digest(token: str) -> str:
    """Hex SHA-256 of a token, as a token file stores it."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh client token: 32 random bytes, URL-safe."""
    return secrets.token_urlsafe(32)


class TokenTable:
    """Token digest -> Principal. ``resolve`` hashes the presented token and looks the digest up.

    Only digests are ever compared, never tokens: the lookup's timing can at most tell how much of
    a *digest* an attacker's guess matched, and a digest prefix does not lead back to a token
    (SHA-256 has no usable preimages), so the token itself never leaks through timing. A lookup
    costs the same for 10 or 10 000 clients (bench/api_overhead.py)."""

    def __init__(self, entries: Iterable[tuple[str, Principal]] = ()):
        self._by_digest: dict[str, Principal] = {}
        for digest, principal in entries:
            self.add(digest, principal)

    def add(self, digest: str, principal: Principal) -> None:
        if not DIGEST_RE.match(digest):
            raise ValueError(f"{principal.name}: sha256 must be 64 lowercase hex digits")
        if digest in self._by_digest:
            other = self._by_digest[digest].name
            raise ValueError(f"{principal.name}: the same token as {other!r}; give each client its own token")
        if any(p.name == principal.name for p in self._by_digest.values()):
            raise ValueError(f"{principal.name}: a client of this name is already defined")
        self._by_digest[digest] = principal

    def add_token(self, token: str, principal: Principal) -> None:
        if not token:
            raise ValueError(f"{principal.name}: the token must not be empty")
        self.add(token_digest(token), principal)

    def replace_token(self, token: str, principal: Principal) -> None:
        """Make ``token`` the table's only one (a guest re-armed by a warm reset: the old token
        stops working at once)."""
        if not token:
            raise ValueError(f"{principal.name}: the token must not be empty")
        self._by_digest = {token_digest(token): principal}

    def resolve(self, token: str) -> Principal | None:
        return self._by_digest.get(token_digest(token))

    def principals(self) -> list[Principal]:
        return list(self._by_digest.values())

    def __len__(self) -> int:
        return len(self._by_digest)


__all__ = ["ADMIN_NAME", "DIGEST_RE", "NAME_RE", "ROLES", "Principal", "Role", "TokenTable", "new_token",
           "token_digest"]
