"""``osfarm stream``: look at and repair episode streams (registered by osfarm/cli.py).

* ``tail``       the last N episodes of a Redis stream or an episodes.jsonl (``--follow`` waits for more)
* ``stats``      length, backlog, and per consumer group: consumers, pending, lag
* ``republish``  put the records a producer spilled to disk (stream full) back on the stream
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

stream_app = typer.Typer(help="Episode streams: tail, stats, republish spilled records.", no_args_is_help=True)

RedisOpt = Annotated[str, typer.Option("--redis", envvar="OSFARM_REDIS", help="Redis URL of the stream")]
StreamOpt = Annotated[str, typer.Option("--stream", envvar="OSFARM_STREAM", help="stream key")]
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_STREAM = "osfarm:episodes"

out = Console()
err = Console(stderr=True)


def _line(rec: dict[str, Any], entry_id: str | None = None) -> str:
    from osfarm.schema.episode import read_record

    r = read_record(rec)
    head = f"{entry_id}  " if entry_id else ""
    return (f"{head}{r.finished_at}  {r.status:<11} score={r.score}  steps={len(r.steps)}  {r.domain}/{r.task_id}"
            f"  attempt={r.attempt}  episode={r.episode_id}")


def _client(url: str) -> Any:
    try:
        from osfarm.stream.redis_stream import connect
    except ImportError:
        err.print("[bold red]error:[/] the redis package is missing: pip install 'osfarm[queue]'")
        raise typer.Exit(1) from None
    r = connect(url)
    try:
        r.ping()
    except Exception as e:  # noqa: BLE001 - any connection failure is reported the same way
        err.print(f"[bold red]error:[/] cannot reach Redis at {url}: {e}", highlight=False)
        raise typer.Exit(1) from None
    return r


def _show(rec: dict[str, Any], entry_id: str | None, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rec, ensure_ascii=False), flush=True)
    else:
        out.print(_line(rec, entry_id), highlight=False, soft_wrap=True)


@stream_app.command("tail")
def tail(
    redis_url: RedisOpt = DEFAULT_REDIS,
    stream: StreamOpt = DEFAULT_STREAM,
    file: Annotated[
        Path | None, typer.Option("--file", help="read an episodes.jsonl instead of Redis", show_default=False)
    ] = None,
    n: Annotated[int, typer.Option("-n", "--lines", min=0, help="how many of the last episodes to show")] = 10,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep waiting for new episodes (Ctrl-C ends)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print whole records as JSON lines")] = False,
) -> None:
    """Show the last episodes (without consuming them: no consumer group is touched)."""
    from osfarm.schema.episode import SchemaError

    try:
        if file is not None:
            from osfarm.stream.jsonl import follow_jsonl, read_jsonl

            if not file.is_file():
                err.print(f"[bold red]error:[/] {file}: no such file")
                raise typer.Exit(1)
            recs = list(read_jsonl(file))
            for rec in recs[len(recs) - n:] if n else []:
                _show(rec, None, as_json)
            if follow:
                for rec in follow_jsonl(file):
                    _show(rec, None, as_json)
            return
        from osfarm.schema.episode import parse_record

        r = _client(redis_url)
        last = r.xrevrange(stream, count=n) if n else []
        for eid, fields in reversed(last):
            _show(parse_record(fields["record"]), eid, as_json)
        if follow:
            cursor = last[0][0] if last else "$"
            while True:
                resp = r.xread({stream: cursor}, block=5000, count=100)
                for eid, fields in (resp[0][1] if resp else []):
                    _show(parse_record(fields["record"]), eid, as_json)
                    cursor = eid
    except SchemaError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        return


@stream_app.command("stats")
def stats(
    redis_url: RedisOpt = DEFAULT_REDIS,
    stream: StreamOpt = DEFAULT_STREAM,
    as_json: Annotated[bool, typer.Option("--json", help="print the figures as JSON")] = False,
) -> None:
    """Length, backlog (not yet acknowledged by the slowest group) and per-group pending/lag."""
    from osfarm.stream.redis_stream import stream_stats

    s = stream_stats(_client(redis_url), stream)
    if as_json:
        print(json.dumps(s, indent=2))
        return
    if not s["exists"]:
        out.print(f"stream {stream}: does not exist yet (no episode published)", highlight=False)
        return
    out.print(f"stream {stream}: length {s['length']}, backlog {s['backlog']}, "
              f"first {s['first_id']}, last {s['last_id']}", highlight=False)
    t = Table("group", "consumers", "pending", "lag", "last delivered")
    for g in s["groups"]:
        names = ", ".join(f"{c['name']} (pending {c['pending']}, idle {c['idle_ms'] / 1000:.0f} s)"
                          for c in g["consumers"])
        t.add_row(g["name"], names or "-", str(g["pending"]), str(g["lag"]), g["last_delivered"])
    out.print(t)


@stream_app.command("republish")
def republish(
    spill: Annotated[Path, typer.Argument(help="spill file written by a producer when the stream was full")],
    redis_url: RedisOpt = DEFAULT_REDIS,
    stream: StreamOpt = DEFAULT_STREAM,
    max_backlog: Annotated[
        int, typer.Option("--max-backlog", min=1, help="stop while the stream holds this many unconsumed episodes")
    ] = 10_000,
) -> None:
    """Publish spilled records again (once per episode id); what still does not fit stays in the file."""
    from osfarm.schema.episode import SchemaError
    from osfarm.stream.redis_stream import RedisStreamSink, republish_spill

    if not spill.is_file():
        err.print(f"[bold red]error:[/] {spill}: no such file")
        raise typer.Exit(1)
    sink = RedisStreamSink(redis_url, stream, max_backlog=max_backlog, client=_client(redis_url))
    try:
        c = republish_spill(sink, spill)
    except SchemaError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
    out.print(f"published {c['published']}, already on the stream {c['duplicate']}, kept in {spill}: {c['kept']}",
              highlight=False)
    if c["kept"]:
        raise typer.Exit(3)
