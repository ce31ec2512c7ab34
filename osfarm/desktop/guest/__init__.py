"""The guest HTTP server that runs in every desktop: the FastAPI app, its native ``/v1`` and
OSWorld-compatible routes, its OpenAPI document, and serving it with uvicorn. Built on ``warm``,
``session``, ``x11`` and ``box``."""
