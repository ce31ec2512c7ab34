"""Trajectory records and where they go: the ``osfarm.episode/1`` schema (record.py), the
content-addressed blob store (blobs.py), run-dir JSONL (jsonl.py) and Redis Streams
(redis_stream.py) sinks and sources, and the ``osfarm stream`` command (cli.py).

Import from the submodules (redis is only needed by redis_stream.py).
"""
