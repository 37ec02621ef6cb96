"""A scripted OpenAI-compatible endpoint on 127.0.0.1 for the LLM Coder's tests.

``POST /v1/chat/completions`` answers with the next scripted reply, in order: a string
is a completion; ``(status, body)`` an HTTP error. Past the script it answers 500, so a
runaway loop ends. Every request is kept (body and headers) for the tests to inspect.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

SECRET = "sk-test-0123456789abcdefSECRETSECRET"


class ScriptedLLM:
    def __init__(self) -> None:
        self.script: list[Any] = []
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def reply(self, *items: Any) -> "ScriptedLLM":
        with self.lock:
            self.script.extend(items)
        return self

    @property
    def prompts(self) -> list[str]:
        """The last user message of each request."""
        return [[m for m in r["body"]["messages"] if m["role"] == "user"][-1]["content"]
                for r in self.requests]

    def _next(self, body: dict[str, Any], headers: dict[str, str]) -> Any:
        with self.lock:
            self.requests.append({"body": body, "headers": headers})
            return self.script.pop(0) if self.script else (500, "script exhausted")

    def _handler(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                item = outer._next(body, {k.lower(): v for k, v in self.headers.items()})
                if isinstance(item, tuple):
                    status, text = item
                    return self._send(status, {"error": {"message": text}})
                prompt = sum(len(m["content"]) for m in body["messages"]) // 4
                self._send(200, {
                    "id": "chatcmpl-test", "object": "chat.completion", "created": 0,
                    "model": body.get("model", "scripted"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": item}}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": len(item) // 4,
                              "total_tokens": prompt + len(item) // 4}})

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


@pytest.fixture
def llm_server():
    server = ScriptedLLM()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()
        server.thread.join(timeout=5)


@pytest.fixture
def llm_client(llm_server):
    pytest.importorskip("openai")
    from stitch_backend.agents.llm import LLMClient

    return LLMClient(llm_server.url, "scripted-model", SECRET, timeout=10, backoff_s=0.01)


@pytest.fixture
def llm_secret() -> str:
    return SECRET


def region_of(fn, *inputs, name: str = "g"):
    """(Subtask, template Candidate) for the first region of ``fn`` traced on ``inputs``
    (proposed, not compiled)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from stitch_backend.agents.coder import TemplateCoder
    from stitch_backend.agents.planner import partition
    from stitch_backend.agents.state import Subtask
    from stitch_backend.regions import region_module

    gm = make_fx(fn)(*inputs)
    plan = partition(gm, name)
    region = next(r for r in plan.regions if r.kind.value == "fused")
    sub = Subtask(region_id=region.id, region_name=f"{name}_{region.name}", kind="fused",
                  ops=region.ops, graph=gm, region=region, module=region_module(gm, region))
    return sub, TemplateCoder().propose(sub)


@pytest.fixture
def pointwise_region():
    import torch

    return region_of(lambda x, y: (torch.relu(x) * y + 1.0,), torch.randn(4, 8), torch.randn(4, 8))


@pytest.fixture
def reduction_region():
    import torch

    return region_of(lambda x: (torch.sum(x * x),), torch.randn(512, 256))
