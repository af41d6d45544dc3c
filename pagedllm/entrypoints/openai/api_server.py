"""`pagedllm serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over AsyncLLM, with OpenAI's error
bodies, an optional API key, Prometheus metrics, and a clean exit (status 0) on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import signal
from collections.abc import AsyncIterator

from pagedllm.entrypoints.openai import serve_extra_missing

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ModuleNotFoundError as error:
    raise serve_extra_missing("pagedllm serve", error) from None

import pagedllm
from pagedllm import envs
from pagedllm.entrypoints.engine_args import engine_kwargs
from pagedllm.entrypoints.openai.async_engine import AsyncLLM, EngineDeadError
from pagedllm.entrypoints.openai.chat_plan import server_parsers
from pagedllm.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BYTES
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    InvalidRequestError,
    TokenizeRequest,
)
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving import ModelNotFoundError, OpenAIServing
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedllm.logger import logger

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def error_response(status: int, message: str, error_type: str, param: str | None = None, code=None) -> Response:
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code))
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's errors -> one readable line, and the first offending top-level field."""
    parts, param = [], None
    for item in error.errors():
        location = [str(part) for part in item.get("loc", ()) if part != "body"]
        if item.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
        named = (item.get("ctx") or {}).get("param")  # RequestModel's check of every value names its field
        if named is not None:
            param = param or named
            parts.append(str(item.get("msg")))
            continue
        if location and param is None:
            param = location[0]
        parts.append(f"{'.'.join(location) or 'body'}: {item.get('msg')}")
    return "; ".join(parts) or "invalid request", param


class APIKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer KEY` (plain ASGI, so streaming and disconnects pass through)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "invalid or missing API key: send the header 'Authorization: Bearer <key>'"
                response = error_response(401, message, "invalid_request_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestSizeLimit:
    """A request body over max_bytes is a 413 (OpenAI's error body), answered before any of it is parsed: at once
    from its Content-Length, or as soon as a body sent in chunks passes the limit."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_bytes:
                await self.refuse(int(declared), scope, receive, send)
            else:
                await self.app(scope, receive, send)  # the server holds the client to its Content-Length
            return
        body, size, more = [], 0, True  # no Content-Length: read it here, counting, then hand it on
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self.refuse(size, scope, receive, send)
                return
        await self.app(scope, replay(b"".join(body), receive), send)

    async def refuse(self, size: int, scope, receive, send) -> None:
        message = (
            f"the request body is {size} bytes or more, over this server's limit of {self.max_bytes} bytes "
            "(pagedllm serve --max-request-bytes)"
        )
        await error_response(413, message, "invalid_request_error", code="request_too_large")(scope, receive, send)


def replay(body: bytes, receive):
    """A receive() that gives the body read already, then what the client sends next (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_again():
        return pending.pop() if pending else await receive()

    return receive_again


async def cancel_on_disconnect(request: Request, work):
    """Run the handler's work, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left first (or this handler was cancelled): stop the work
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it: the client left
    return task.result()


def openai_response(result) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(result.model_dump_json(), media_type="application/json")


def build_app(
    serving: OpenAIServing,
    metrics: ServerMetrics,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    app = FastAPI(title="pagedllm", version=pagedllm.__version__, docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        message, param = validation_message(error)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, error: InvalidRequestError):
        return error_response(400, str(error), "invalid_request_error", error.param)

    @app.exception_handler(ValueError)
    async def invalid_value(request: Request, error: ValueError):
        return error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(TypeError)
    async def invalid_type(request: Request, error: TypeError):
        return error_response(400, str(error), "invalid_request_error")

    @app.exception_handler(ModelNotFoundError)
    async def unknown_model(request: Request, error: ModelNotFoundError):
        return error_response(404, str(error), "invalid_request_error", "model", "model_not_found")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError):
        return error_response(503, str(error), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return error_response(error.status_code, str(error.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("internal error while serving %s", request.url.path)
        return error_response(500, "internal server error; see the server log", "server_error")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if serving.llm.is_running else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        return openai_response(serving.models())

    @app.get("/v1/models/{model_id:path}")  # a served name may hold slashes ("Qwen/Qwen3-0.6B")
    async def model(model_id: str) -> Response:
        return openai_response(serving.model_card(model_id))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return openai_response(await cancel_on_disconnect(request, serving.create_completion(body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return openai_response(await cancel_on_disconnect(request, serving.create_chat_completion(body)))

    responses = OpenAIServingResponses(serving)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return openai_response(await cancel_on_disconnect(request, responses.create_response(body)))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return Response(await serving.tokenize(body), media_type="application/json")

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return serving.tokenizer_info()

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await serving.detokenize(body)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if max_request_bytes:  # outermost: a body over the limit is refused before anything else reads it
        app.add_middleware(RequestSizeLimit, max_bytes=max_request_bytes)
    return app


class Server(uvicorn.Server):
    """uvicorn's server, but SIGINT/SIGTERM first end every in-flight stream (their requests are aborted and the
    streams close with [DONE]), then uvicorn stops gracefully; the signal is not re-raised, so the exit is 0."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM):
        super().__init__(config)
        self.llm = llm

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def stop(self) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        self.llm.abort_all()


def run_server(args: argparse.Namespace) -> None:
    if args.max_request_bytes < 0:
        raise ValueError(f"--max-request-bytes must be >= 0 (0: no limit), got {args.max_request_bytes}")
    api_key = args.api_key or envs.API_KEY.get() or None
    engine = engine_kwargs(args, "serve")
    llm = AsyncLLM(num_threads=args.threads, core_in_thread=args.engine_core_in_thread, **engine)
    try:
        if args.model is None:
            from pagedllm.loader.default_model import default_model_path

            name, root = DEFAULT_SERVED_NAME, str(default_model_path())
        else:
            name, root = args.model, os.path.abspath(os.path.expanduser(args.model))
        name = args.served_model_name or name
        parsers = server_parsers(
            args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser, llm.tokenizer
        )
        metrics = ServerMetrics(name, llm.max_model_len)
        llm.stats_listener = metrics
        app = build_app(OpenAIServing(llm, name, root, parsers), metrics, api_key, args.max_request_bytes)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=10,
        )
        logger.info("serving %s at http://%s:%d/v1%s", name, args.host, args.port, " (API key set)" if api_key else "")
        asyncio.run(Server(config, llm).serve())
    finally:
        llm.shutdown()
