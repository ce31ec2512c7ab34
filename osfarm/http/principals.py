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

Sources, merged: the ``tokens_file`` setting (YAML, below), the ``tokens`` setting
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
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from osfarm.config import ConfigError, read_yaml_mapping, validation_message

Role = Literal["admin", "client", "viewer"]
ROLES: tuple[Role, ...] = ("admin", "client", "viewer")
ADMIN_NAME = "admin"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


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
        if not _HEX64.match(digest):
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


class TokenEntry(BaseModel):
    """One client of a token file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_NAME.pattern, description="the client's name (logs, lease ownership)")
    role: Role = "client"
    sha256: str = Field(pattern=_HEX64.pattern, description="hex SHA-256 of the client's token")
    max_leases: int | None = Field(default=None, ge=1)
    max_ttl_s: float | None = Field(default=None, gt=0)

    def principal(self) -> Principal:
        return Principal(self.name, self.role, self.max_leases, self.max_ttl_s)


class TokenFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clients: list[TokenEntry] = Field(default_factory=list)


def read_token_file(path: Path) -> list[TokenEntry]:
    """The entries of a token file; errors name ``FILE:LINE`` and the key."""
    data, text = read_yaml_mapping(path)
    try:
        entries = TokenFile.model_validate(data).clients
    except ValidationError as e:
        raise ConfigError(validation_message(e, path, text)) from None
    names = [e.name for e in entries]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{path}: client {name!r} is listed twice")
    return entries


def parse_token_list(text: str, source: str = "OSFARM_TOKENS") -> list[tuple[str, Principal]]:
    """``name:role:secret[:max_leases[:max_ttl_s]]``, comma-separated: (digest, principal) pairs.
    ``secret`` is ``sha256:<hex>`` or the raw token (hashed here, never kept)."""
    out: list[tuple[str, Principal]] = []
    for i, item in enumerate(p.strip() for p in text.split(",")):
        if not item:
            continue
        where = f"{source}: entry {i + 1}"
        parts = item.split(":")
        if len(parts) >= 4 and parts[2] == "sha256":  # name:role:sha256:<hex>[:...]
            name, role, _, digest, *limits = parts
        elif len(parts) >= 3:
            name, role, raw, *limits = parts
            if not raw:
                raise ConfigError(f"{where} ({name}): empty token")
            digest = token_digest(raw)
        else:
            raise ConfigError(f"{where}: expected name:role:token[:max_leases[:max_ttl_s]]")
        if not _NAME.match(name):
            raise ConfigError(f"{where}: name {name!r}: letters, digits, '.', '_', '@', '-' only (at most 64)")
        if role not in ROLES:
            raise ConfigError(f"{where} ({name}): role {role!r}: expected one of {', '.join(ROLES)}")
        if not _HEX64.match(digest):
            raise ConfigError(f"{where} ({name}): sha256 must be 64 lowercase hex digits")
        if len(limits) > 2:
            raise ConfigError(f"{where} ({name}): too many fields")
        try:
            max_leases = int(limits[0]) if len(limits) > 0 and limits[0] else None
            max_ttl = float(limits[1]) if len(limits) > 1 and limits[1] else None
        except ValueError:
            raise ConfigError(f"{where} ({name}): max_leases and max_ttl_s must be numbers") from None
        if (max_leases is not None and max_leases < 1) or (max_ttl is not None and max_ttl <= 0):
            raise ConfigError(f"{where} ({name}): max_leases must be >= 1 and max_ttl_s > 0")
        out.append((digest, Principal(name, role, max_leases, max_ttl)))  # type: ignore[arg-type]
    return out


def build_token_table(admin_token: str, tokens: str = "", tokens_file: Path | None = None,
                      client_max_leases: int | None = None, client_max_ttl_s: float | None = None) -> TokenTable:
    """Every principal the farm knows: the admin token, the token file, the env list. A client
    without limits of its own gets ``client_max_leases``/``client_max_ttl_s``. Raises
    ConfigError naming the source of a bad entry or a clash."""
    table = TokenTable()
    pairs: list[tuple[str, Principal, str]] = []
    if tokens_file is not None:
        pairs += [(e.sha256, e.principal(), str(tokens_file)) for e in read_token_file(tokens_file)]
    pairs += [(d, p, "OSFARM_TOKENS") for d, p in parse_token_list(tokens)]
    if admin_token:
        pairs.append((token_digest(admin_token), Principal(ADMIN_NAME, "admin"), "the farm token (OSFARM_TOKEN)"))
    for digest, p, source in pairs:
        if p.role == "client":
            p = Principal(p.name, p.role, p.max_leases if p.max_leases is not None else client_max_leases,
                          p.max_ttl_s if p.max_ttl_s is not None else client_max_ttl_s)
        try:
            table.add(digest, p)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None
    return table


__all__ = ["ADMIN_NAME", "ROLES", "Principal", "Role", "TokenEntry", "TokenTable", "build_token_table",
           "new_token", "parse_token_list", "read_token_file", "token_digest"]
