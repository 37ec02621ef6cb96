"""A thin client for any OpenAI-compatible chat endpoint, used by the LLM Coder.

This is the only module that imports ``openai`` (lazily, when a client is made): the
package is optional and absent from the GPU image. Requests are bounded (a timeout per
request, a few retries on connection errors, timeouts, 429 and 5xx), and every failure
is an ``LLMError`` that names the endpoint URL and never the API key: any text that
leaves this module has the key redacted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

log = logging.getLogger("stitch_backend.agents.llm")

INSTALL_HINT = "pip install 'stitchcuda[llm]'"
# Sent when no key is configured: local servers (vLLM, llama.cpp) ignore it, and the
# openai client refuses to start without one.
NO_KEY = "unused"


class LLMUnavailable(RuntimeError):
    """The optional ``openai`` package is not installed."""


class LLMError(RuntimeError):
    """A request to the endpoint failed (unreachable, HTTP error, timeout, bad reply).
    ``url`` is the endpoint; ``status`` the HTTP status when there was one."""

    def __init__(self, message: str, url: str, status: int | None = None):
        self.url = url
        self.status = status
        super().__init__(message)


@dataclass(frozen=True)
class LLMReply:
    """One completion: the text and what it cost."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def redact(text: str, secret: str) -> str:
    """``text`` with ``secret`` (and, for long secrets, its leading and trailing eight
    characters, which servers echo in "incorrect key sk-abcd...wxyz" messages) removed."""
    if not secret or secret == NO_KEY:
        return text
    out = text.replace(secret, "[REDACTED]")
    if len(secret) >= 16:
        out = out.replace(secret[:8], "[REDACTED]").replace(secret[-8:], "[REDACTED]")
    return out


def _import_openai() -> Any:
    try:
        import openai
    except ImportError as err:
        raise LLMUnavailable(f"the LLM Coder needs the openai package: {INSTALL_HINT}") from err
    return openai


class LLMClient:
    """Chat completions against ``base_url`` with ``model``.

    ``complete(messages)`` returns an ``LLMReply`` or raises ``LLMError``; making the
    client raises ``LLMUnavailable`` when ``openai`` is missing. The key is held here
    and handed to the openai client only."""

    def __init__(self, base_url: str, model: str, api_key: str = "", *,
                 timeout: float = 120.0, max_tokens: int = 8192, retries: int = 2,
                 backoff_s: float = 0.5, temperature: float | None = None):
        if not base_url:
            raise ValueError("LLMClient needs a base_url (STITCHCUDA_LLM_BASE_URL)")
        if not model:
            raise ValueError("LLMClient needs a model name (STITCHCUDA_LLM_MODEL)")
        openai = _import_openai()
        self.base_url = base_url
        self.model = model
        self.timeout = timeout
        self.max_tokens = max_tokens
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.temperature = temperature
        self._key = api_key or NO_KEY
        self._openai = openai
        # Retries are ours (bounded, logged); the client's own are off.
        self._client = openai.OpenAI(base_url=base_url, api_key=self._key, timeout=timeout,
                                     max_retries=0)

    def __repr__(self) -> str:  # never the key
        return f"LLMClient(base_url={self.base_url!r}, model={self.model!r})"

    def redact(self, text: str) -> str:
        """``text`` with this client's API key removed."""
        return redact(text, self._key)

    def complete(self, messages: Sequence[dict[str, str]]) -> LLMReply:
        """One chat completion for ``messages`` ({"role", "content"} dicts). Connection
        errors, timeouts, 429 and 5xx are retried ``retries`` times; every failure
        raises ``LLMError`` naming the endpoint."""
        oa = self._openai
        last: LLMError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * (2 ** (attempt - 1)))
            t0 = time.perf_counter()
            try:
                kwargs: dict[str, Any] = {"model": self.model, "messages": list(messages),
                                          "max_tokens": self.max_tokens}
                if self.temperature is not None:
                    kwargs["temperature"] = self.temperature
                resp = self._client.chat.completions.create(**kwargs)
            except oa.APITimeoutError:
                last = LLMError(f"LLM endpoint {self.base_url} timed out after "
                                f"{self.timeout:g} s", self.base_url)
            except oa.APIConnectionError as err:
                last = LLMError(f"LLM endpoint {self.base_url} is unreachable: "
                                f"{self.redact(_cause(err))}", self.base_url)
            except oa.APIStatusError as err:
                status = err.status_code
                last = LLMError(f"LLM endpoint {self.base_url} answered HTTP {status}: "
                                f"{self.redact(str(err))[:500]}", self.base_url, status)
                if status != 429 and status < 500:
                    raise last from None
            except oa.OpenAIError as err:
                raise LLMError(f"LLM request to {self.base_url} failed: "
                               f"{self.redact(str(err))[:500]}", self.base_url) from None
            else:
                return self._reply(resp, time.perf_counter() - t0)
            log.info("%s (attempt %d of %d)", last, attempt + 1, self.retries + 1)
        assert last is not None
        raise last

    def _reply(self, resp: Any, seconds: float) -> LLMReply:
        try:
            text = resp.choices[0].message.content or ""
        except (AttributeError, IndexError, TypeError) as err:
            raise LLMError(f"LLM endpoint {self.base_url} sent a reply without a message "
                           f"({type(err).__name__})", self.base_url) from None
        usage = getattr(resp, "usage", None)
        return LLMReply(text=text,
                        prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                        completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                        seconds=seconds)


def _cause(err: BaseException) -> str:
    """The innermost reason of a connection error ("Connection refused"), not a traceback."""
    inner: BaseException = err
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = str(inner) or type(inner).__name__
    return text if inner is err else f"{err} ({text})"


def client_from_config(cfg: Any) -> LLMClient | None:
    """The client the settings ask for (``coder == "template+llm"`` and an endpoint and a
    model set), else None. Raises ``LLMUnavailable`` when openai is missing."""
    from stitch_backend.config import llm_api_key

    if cfg.coder != "template+llm" or not cfg.llm_base_url or not cfg.llm_model:
        return None
    return LLMClient(cfg.llm_base_url, cfg.llm_model, llm_api_key(),
                     timeout=float(cfg.llm_timeout_s), max_tokens=cfg.llm_max_tokens)
