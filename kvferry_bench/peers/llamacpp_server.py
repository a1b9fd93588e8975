"""llama.cpp's own OpenAI server for ``kvferry bench peers``: run by the llama.cpp venv's python.

    python llamacpp_server.py [python -m llama_cpp.server options]

Exactly ``python -m llama_cpp.server`` with one difference: the ``x-request-id`` header is
dropped before the server sees it. vLLM's ``bench serve`` client names every request
``bench-<hex>-<index>`` in that header, and llama-cpp-python's server (its
starlette-context ``RequestIdPlugin``) answers any id that is not a UUID with 400 Bad
Request, so without this every request of the serving client fails. And no SSE ping
comments: the server sends ``: ping`` every 15 s of a stream (so first, to a request
that waits its turn that long), and vLLM 0.32's client strips each network chunk before
it looks for the blank line that ends an event, so after a ping it never parses another
event and counts the request as failed. Imports nothing of kvferry.
"""

from __future__ import annotations

REQUEST_ID = b"x-request-id"
NO_PING_S = 10**9  # sse-starlette's ping interval: never within a benchmark


def without_request_id(app):
    """An ASGI app that is `app` with the x-request-id header removed from HTTP requests."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k.lower() != REQUEST_ID])
        await app(scope, receive, send)

    return wrapped


def main() -> None:
    import llama_cpp.server.__main__ as server
    from sse_starlette.sse import EventSourceResponse

    EventSourceResponse.DEFAULT_PING_INTERVAL = NO_PING_S

    create_app = server.create_app
    server.create_app = lambda **settings: without_request_id(create_app(**settings))
    server.main()


if __name__ == "__main__":
    main()
