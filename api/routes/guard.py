"""The control routes' guard: they can stop generation for everyone, so they exist only when
the server is started with `--enable-control-api`; without it each answers 404 saying so."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from quart import Response
from quart_trio import QuartTrio

from api.http.errors import APIError
from api.http.state import ServerState

Handler = Callable[[], Awaitable[Response]]
Route = Callable[[Handler], Handler]


def control_routes(app: QuartTrio, state: ServerState) -> Callable[..., Route]:
    """A decorator, `@route(rule, methods=...)`, for routes behind --enable-control-api."""

    def route(rule: str, methods: Sequence[str] = ("POST",)) -> Route:
        def wrap(handler: Handler) -> Handler:
            async def guarded() -> Response:
                if not state.settings.enable_control_api:
                    raise APIError(
                        404,
                        f"{rule} is off: start the server with --enable-control-api",
                        code="control_api_disabled",
                    )
                return await handler()

            guarded.__name__ = handler.__name__
            app.add_url_rule(rule, view_func=guarded, methods=list(methods))
            return handler

        return wrap

    return route
