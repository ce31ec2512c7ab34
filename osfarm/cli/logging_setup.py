"""The farm's log: one line per event on stderr, logfmt (``--log-format logfmt``) or JSON, with
uvicorn's loggers routed through it and httpx's per-request lines kept out."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=info logger=osfarm.farm.pool msg="..."``: one greppable line per event."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).isoformat(timespec="milliseconds")
        fields = {"ts": ts, "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        line = " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += " exc=" + _logfmt_value(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _logfmt_value(v: str) -> str:
    if v and not any(c in v for c in ' ="\n\t'):
        return v
    return json.dumps(v)


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # httpx logs every request at info: the pool's guest health checks would flood the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
