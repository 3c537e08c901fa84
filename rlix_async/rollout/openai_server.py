"""The OpenAI-compatible server of an ``agent_api`` pipeline (aiohttp, on the driver's
event loop): ``/v1/chat/completions`` (``stream`` too: the whole reply as one delta),
``/v1/completions``, ``/v1/models``.

Every request names its episode by its key (``Authorization: Bearer KEY``): a key is
made for each episode when it starts and forgotten when it ends, so a request without
a live key is refused (401) and one episode's agent cannot write into another's. The
server binds to loopback unless ``agent_api_host`` names another address (an agent in
a container then reaches it by the URL and key it was handed). Bad input is a JSON
error with the status OpenAI's API would give (400 malformed, 401 key, 404 path, 409
a second request of one episode while one runs, 413 too large, 503 generation
failed), never a traceback or a dead server: each handler's failures end in its own
response.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
from typing import Any, Protocol

from aiohttp import web
from yarl import URL

log = logging.getLogger("rlix_async.openai_server")
MAX_BODY = 8 << 20  # a request's JSON, at most (long agentic histories fit)


class ApiError(Exception):
    """A request refused: its HTTP status and an OpenAI-style message."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class Served(Protocol):
    """What a key serves: one episode's requests (rollout/api_episode.py)."""

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]: ...


def _error(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status)


def chunks(reply: dict[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A whole chat completion as the chunks a stream of it sends: the message in one
    delta, then the finish reason (then the usage, when asked). Generation is not
    streamed token by token: the trajectory is whole before the first byte leaves."""
    base = {k: reply[k] for k in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk"
    (choice,) = reply["choices"]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    out = [
        {**base, "choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"],
                              "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                              "finish_reason": choice["finish_reason"]}]},
    ]  # fmt: skip
    if usage:
        out.append({**base, "choices": [], "usage": reply["usage"]})
    return out


async def _stream(request: web.Request, reply: dict[str, Any], usage: bool) -> web.StreamResponse:
    """Server-sent events, as OpenAI's API streams (``data: {...}``, then ``[DONE]``)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    for chunk in chunks(reply, usage):
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


class ApiServer:
    """Listens on ``host`` (an ephemeral port); ``url`` is what clients are given."""

    def __init__(self, host: str, model_name: str) -> None:
        self.host = host
        self.model_name = model_name
        self.episodes: dict[str, Served] = {}
        self._count = 0
        self._sock: socket.socket | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    def new_key(self) -> tuple[str, str]:
        """A fresh episode key and the episode's short name (tool call ids use it)."""
        self._count += 1
        return f"rlix-{secrets.token_urlsafe(24)}", f"ep{self._count}"

    def open(self, key: str, episode: Served) -> None:
        self.episodes[key] = episode

    def close_key(self, key: str) -> None:
        self.episodes.pop(key, None)

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            await self._runner.cleanup()
            raise
        self._sock = sock
        site = web.SockSite(self._runner, sock)
        await site.start()
        port = sock.getsockname()[1]
        self.url = str(URL.build(scheme="http", host=self.host, port=port, path="/v1"))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.close()

    def close(self) -> None:
        """The listening socket closed (no new connections), from any context."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _episode(self, request: web.Request) -> Served:
        auth = request.headers.get("Authorization", "")
        key = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""
        episode = self.episodes.get(key) if key else None
        if episode is None:
            raise ApiError(401, "no live episode has this API key", "invalid_api_key")
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._episode(request)
        except ApiError as exc:
            return _error(exc.status, exc.message, exc.code)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlix-async"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            episode = self._episode(request)
            body = await _body(request)
            if not chat:
                return web.json_response(await episode.complete(body))
            reply = await episode.chat(body)
            if body.get("stream"):
                options = body.get("stream_options")
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
                return await _stream(request, reply, usage)
            return web.json_response(reply)
        except ApiError as exc:
            return _error(exc.status, exc.message, exc.code, exc.param)
        except Exception as exc:  # never the server's end: this request's only
            log.exception("agent_api: a request failed")
            return _error(500, f"{type(exc).__name__}: {exc}")


async def _body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object (ApiError: too large, not JSON, not an object, or text
    no tokenizer takes)."""
    try:
        body = json.loads(await request.read())
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request is over {MAX_BODY} bytes") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:  # JSON may escape what no tokenizer takes: a lone UTF-16 surrogate
        json.dumps(body, ensure_ascii=False).encode()
    except (UnicodeEncodeError, ValueError) as exc:
        raise ApiError(400, f"the body holds text that is not valid Unicode: {exc}") from None
    return body
