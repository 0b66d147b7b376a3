"""The OpenAI-compatible HTTP endpoint over a rollout engine, alive for one rollout.

    with AgentServer(engine, tokenizer, defaults) as server:   # binds 127.0.0.1 on a free port
        client = openai.OpenAI(base_url=server.base_url, api_key="rl3d")
        ...
    server.sessions  # every completion, by session

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``. The
session of a request is its ``X-Session-Id`` header, else the body's ``session_id`` field, else
its ``user`` field. ``stream: true`` gets the finished reply as server-sent events (one chunk
per choice, then its finish reason), for clients that always stream. A body over
`max_body_bytes`, not JSON, or with a bad field gets OpenAI's error JSON (413 / 400); an
unknown route 404. Each connection runs in its own thread; the
generation itself is batched across them (`rl3d.agents.batcher`). Leaving the block stops the
server and the batcher (after the engine call in progress), so the engine is free for training.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rl3d.agents.batcher import GenerateBatcher
from rl3d.agents.chat import ChatFormat
from rl3d.agents.endpoint import AgentEndpoint
from rl3d.agents.protocol import RequestError, stream_events
from rl3d.agents.sessions import SessionLog
from rl3d.rollout.base import RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"  # loopback only: the policy is served to agents on this machine
_POLL_S = 0.01


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # a reply goes out as two writes (headers, body): with Nagle's algorithm the second waits
    # for the client's delayed ACK, 40 ms per request on Linux loopback
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the stdlib's name)
        logger.debug("agent endpoint: " + format, *args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: list[dict[str, Any]]) -> None:
        """Server-sent events, the body ending with the connection (generation is over: the
        events are sent at once)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _route(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    def do_GET(self) -> None:  # noqa: N802  (the stdlib's name)
        if self._route() == "/v1/models":
            self._send(200, self.server.endpoint.models())
        else:
            self._send(404, RequestError(f"no route GET {self._route()}", status=404).body())

    def do_POST(self) -> None:  # noqa: N802
        handlers = {
            "/v1/chat/completions": self.server.endpoint.chat_completion,
            "/v1/completions": self.server.endpoint.completion,
        }
        try:
            handler = handlers.get(self._route())
            if handler is None:
                raise RequestError(f"no route POST {self._route()}", status=404)
            body = self._body()
            session = self.headers.get("X-Session-Id") or body.get("session_id") or body.get("user") or ""
            response = handler(body, str(session))
            if body.get("stream"):
                options = body.get("stream_options") or {}
                self._stream(stream_events(response, usage=bool(options.get("include_usage"))))
            else:
                self._send(200, response)
        except RequestError as err:
            self._send(err.status, err.body())
        except Exception as err:  # never a dropped connection: the agent gets an error to handle
            logger.exception("agent endpoint: request failed")
            self._send(500, RequestError(f"{type(err).__name__}: {err}", status=500).body())

    def _body(self) -> dict[str, Any]:
        try:
            size = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            raise RequestError("a Content-Length header is required", status=411) from None
        limit = self.server.max_body_bytes
        if size < 0 or size > limit:
            self.close_connection = True  # the body is not read
            raise RequestError(f"request body of {size} bytes is over the limit of {limit}", status=413)
        try:
            body = json.loads(self.rfile.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise RequestError(f"the body is not valid JSON: {err}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # many agents connect at once (the stdlib's default backlog is 5)
    endpoint: AgentEndpoint
    max_body_bytes: int


class AgentServer:
    """The endpoint for one rollout on `engine`; `defaults` are the rollout's sampling settings.
    `chat` sets how messages become ids (`ChatFormat(tokenizer)` by default)."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        defaults: SamplingParams,
        *,
        chat: ChatFormat | None = None,
        max_batch_rows: int = 64,
        batch_wait_s: float = 0.005,
        max_body_bytes: int = 4 << 20,
        model_name: str = "rl3d-policy",
        parallel_tool_calls: bool = False,
        live_agents: Callable[[], int] | None = None,
    ):
        self.chat = chat or ChatFormat(tokenizer)
        self.defaults, self.model_name = defaults, model_name
        self.parallel_tool_calls = parallel_tool_calls
        self.live_agents = live_agents  # how many agents are running (`GenerateBatcher.live`)
        self.engine, self.max_batch_rows, self.batch_wait_s = engine, max_batch_rows, batch_wait_s
        self.max_body_bytes = max_body_bytes
        # ids the engine takes: the model's vocabulary (padded past the tokenizer's, and it may
        # sample there), else the tokenizer's
        self.vocab_size = getattr(getattr(engine, "spec", None), "vocab_size", None) or len(tokenizer)
        self._httpd: _Server | None = None
        self.batcher: GenerateBatcher | None = None
        self.endpoint: AgentEndpoint | None = None

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "the server is not running"
        return f"http://{HOST}:{self._httpd.server_address[1]}/v1"

    @property
    def sessions(self) -> SessionLog:
        assert self.endpoint is not None, "the server has not run"
        return self.endpoint.sessions

    def start(self) -> AgentServer:
        self.batcher = GenerateBatcher(
            self.engine, max_rows=self.max_batch_rows, wait_s=self.batch_wait_s, seed=self.defaults.seed,
            live=self.live_agents,
        )  # fmt: skip
        self.endpoint = AgentEndpoint(
            self.batcher, self.chat, self.defaults, vocab_size=self.vocab_size, model_name=self.model_name,
            parallel_tool_calls=self.parallel_tool_calls,
        )  # fmt: skip
        httpd = _Server((HOST, 0), _Handler)  # port 0: the OS picks a free one, no race
        httpd.endpoint, httpd.max_body_bytes = self.endpoint, self.max_body_bytes
        # `shutdown` waits for the loop's next poll: the stdlib's 0.5 s would be paid every rollout
        serve = lambda: httpd.serve_forever(poll_interval=_POLL_S)  # noqa: E731
        threading.Thread(target=serve, name="rl3d-agent-http", daemon=True).start()
        self._httpd = httpd
        logger.info("agent endpoint at %s", self.base_url)
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self.batcher is not None:
            self.batcher.close()

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
