"""The farm's clients from its settings, into a :class:`~osfarm.http.principals.TokenTable`:
the ``tokens_file`` setting (YAML, format in :mod:`osfarm.http.principals`), the ``tokens``
setting (``OSFARM_TOKENS``) and the admin ``token``.

Apart from :mod:`osfarm.http.principals` because only the farm (and ``osfarm tokens``) reads
these sources: the guest server, which knows one token and no file, does not import the settings
and YAML stack they need (pydantic-settings, PyYAML: ~40 ms of every desktop's cold start).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from osfarm.config import ConfigError, read_yaml_mapping, validation_message
from osfarm.http.principals import ADMIN_NAME, DIGEST_RE, NAME_RE, ROLES, Principal, Role, TokenTable, token_digest


class TokenEntry(BaseModel):
    """One client of a token file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_RE.pattern, description="the client's name (logs, lease ownership)")
    role: Role = "client"
    sha256: str = Field(pattern=DIGEST_RE.pattern, description="hex SHA-256 of the client's token")
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
        if not NAME_RE.match(name):
            raise ConfigError(f"{where}: name {name!r}: letters, digits, '.', '_', '@', '-' only (at most 64)")
        if role not in ROLES:
            raise ConfigError(f"{where} ({name}): role {role!r}: expected one of {', '.join(ROLES)}")
        if not DIGEST_RE.match(digest):
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
        out.append((digest, Principal(name, role, max_leases, max_ttl)))
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


__all__ = ["TokenEntry", "TokenFile", "build_token_table", "parse_token_list", "read_token_file"]
