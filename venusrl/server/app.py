"""`venusrl serve`: the engine behind HTTP. OpenAI-compatible completions and chat
(`server.openai_routes`) and the native token-level API (`server.native_routes`); every error
is a 4xx/5xx that says what is wrong (`server.errors`), and one bad request never disturbs the
others."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from venusrl.engine.engine import Engine
from venusrl.server import native_routes, openai_routes
from venusrl.server.errors import error_response, install_error_handlers
from venusrl.server.served import Served


def create_app(
    engine: Engine, model_name: str, api_key: str | None = None, tool_parser: str = "auto"
) -> FastAPI:
    """The app; the engine's thread starts and stops with it. `tool_parser` reads tool calls in
    the model's text (`server.tool_calling`)."""
    model = Served(engine, model_name, tool_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model.runner.start()
        yield
        model.runner.stop()

    app = FastAPI(title="venusrl engine", lifespan=lifespan)
    app.state.served = model
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    install_error_handlers(app)
    app.include_router(native_routes.router)
    app.include_router(openai_routes.router)
    return app


class ApiKeyCheck:
    """Refuses every path but /health without the key. Plain ASGI: a `@app.middleware("http")`
    (Starlette's BaseHTTPMiddleware) hides the client's disconnect from the endpoint, so a
    request whose client went away would run to its end."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = Headers(scope=scope).get("authorization", "")
            if not hmac.compare_digest(given.encode(), self.expected):
                response = error_response(
                    401, "missing or wrong API key (Authorization: Bearer ...)"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
