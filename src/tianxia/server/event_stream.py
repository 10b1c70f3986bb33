"""Server-sent events with each chunk handed straight to the HTTP server.

A streamed token passes, as an ASGI ``http.response.body`` message, through every middleware's
``send`` wrapper on its way out: Starlette's error and exception middlewares, CORS and the
server's own statistics, each a Python call per chunk, together about a tenth of an API process's
time while it streams at saturation. Every middleware of this server acts on the response's start
only (status, headers). So the app records the HTTP server's own ``send`` in the scope
(:data:`DIRECT_SEND`), and :class:`EventStreamResponse` sends the start and the final message
through the middleware chain, and the chunks between them directly. A middleware that rewrites
bodies (compression) must not be added in front of it.

Each body message is a write to the socket (a system call). A stream's last events (the final
token's chunk, the usage chunk, ``[DONE]``) come out of its generator as one piece ending in
:data:`SSE_DONE`, which goes out as the final message: with the body's end, one write where there
were up to four (a request for a few tokens spent a tenth of its API-process time in them).
"""

from __future__ import annotations

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DIRECT_SEND = "tianxia.direct_send"
SSE_DONE = b"data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._direct: Send | None = scope.get(DIRECT_SEND)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        body_send = self._direct or send
        ended = False
        async for chunk in self.body_iterator:
            if ended:
                continue  # nothing follows [DONE]; the generator still runs to its end
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            if chunk.endswith(SSE_DONE):
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                ended = True
            else:
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
