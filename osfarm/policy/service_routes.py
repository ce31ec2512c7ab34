"""Routes about the server itself: liveness (``/health``, the one route without a token when the
server has one), the Prometheus metrics and the served models (the base and its LoRA adapters).

``router`` is included by :func:`osfarm.policy.server.create_app`; the routes get the engine and
the metrics through :mod:`osfarm.policy.state`'s dependencies.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from osfarm.policy.replies import VERSION_HEADER
from osfarm.policy.schemas import Health, ModelCard, ModelList
from osfarm.policy.state import Engine, Metrics

router = APIRouter()

# Paths served without the token (the auth middleware is told so), as vLLM's.
PUBLIC_PATHS = ("/health",)


@router.get("/health", response_model=Health)
async def health(response: Response, engine: Engine) -> Health:
    response.headers[VERSION_HEADER] = str(engine.current.version)
    return Health(model=engine.served_name, policy_version=engine.current.version, reloading=engine.reloading)


@router.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def prometheus(metrics: Metrics) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList)
async def models(response: Response, engine: Engine) -> ModelList:
    policy = engine.current
    response.headers[VERSION_HEADER] = str(policy.version)
    card = ModelCard(
        id=engine.served_name,
        created=int(policy.loaded_at),
        root=policy.source,
        max_model_len=engine.max_model_len,
        policy_version=policy.version,
    )
    adapters = [
        ModelCard(
            id=a.name, created=int(a.loaded_at), root=a.path, parent=engine.served_name,
            max_model_len=engine.max_model_len,
        )
        for a in engine.adapters.values()
    ]
    return ModelList(data=[card, *adapters])
