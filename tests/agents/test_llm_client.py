"""The LLM client over the real openai package against a scripted local endpoint."""

from __future__ import annotations

import importlib.util
import logging
import socket
import sys
import time

import pytest

from stitch_backend import config as config_mod
from stitch_backend.agents.llm import (LLMClient, LLMError, LLMUnavailable, client_from_config,
                                       redact)

needs_openai = pytest.mark.skipif(importlib.util.find_spec("openai") is None,
                                  reason="needs the openai package (the 'test' extra)")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens


def test_completion_text_usage_and_key_in_header_only(llm_server, llm_client, llm_secret):
    llm_server.reply("hello")
    reply = llm_client.complete([{"role": "user", "content": "hi"}])
    assert reply.text == "hello"
    assert reply.prompt_tokens >= 0 and reply.completion_tokens == 1 and reply.seconds > 0
    (req,) = llm_server.requests
    assert req["body"]["model"] == "scripted-model"
    assert req["headers"]["authorization"] == f"Bearer {llm_secret}"
    assert llm_secret not in repr(llm_client)


@needs_openai
def test_unreachable_endpoint_names_the_url_quickly(llm_secret):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    client = LLMClient(url, "m", llm_secret, timeout=5)  # default retries and backoff
    t0 = time.perf_counter()
    with pytest.raises(LLMError) as info:
        client.complete([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 5
    assert url in str(info.value) and "unreachable" in str(info.value)
    assert llm_secret not in str(info.value)


def test_server_errors_are_retried_then_reported(llm_server, llm_client):
    llm_server.reply((500, "boom"), (503, "busy"), "third time lucky")
    assert llm_client.complete([{"role": "user", "content": "x"}]).text == "third time lucky"
    llm_server.reply((500, "a"), (500, "b"), (500, "c"), "never reached")
    with pytest.raises(LLMError) as info:
        llm_client.complete([{"role": "user", "content": "x"}])
    assert info.value.status == 500 and llm_server.url in str(info.value)
    assert len(llm_server.requests) == 6  # 3 + 3: two retries each


def test_client_errors_are_not_retried_and_the_key_is_redacted(llm_server, llm_client,
                                                                 llm_secret, caplog):
    caplog.set_level(logging.DEBUG)
    llm_server.reply((401, f"Incorrect API key provided: {llm_secret}"), "unused")
    with pytest.raises(LLMError) as info:
        llm_client.complete([{"role": "user", "content": "x"}])
    assert info.value.status == 401 and len(llm_server.requests) == 1
    assert llm_secret not in str(info.value) and "[REDACTED]" in str(info.value)
    assert llm_secret not in caplog.text


def test_openai_missing_gives_llm_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai -> ImportError
    with pytest.raises(LLMUnavailable, match=r"pip install 'stitchcuda\[llm\]'"):
        LLMClient("http://127.0.0.1:1/v1", "m", "k")


@needs_openai
def test_client_from_config_and_the_key_from_the_environment(monkeypatch, llm_secret):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("STITCHCUDA_LLM_API_KEY", llm_secret)
    assert config_mod.llm_api_key() == llm_secret
    assert config_mod.llm_api_key({"OPENAI_API_KEY": "b"}) == "b"
    cfg = config_mod.Config.from_env({"STITCHCUDA_LLM_BASE_URL": "http://127.0.0.1:1/v1",
                                      "STITCHCUDA_LLM_MODEL": "m"})
    assert client_from_config(cfg) is None  # coder is "template"
    client = client_from_config(cfg.with_options({"coder": "template+llm"}))
    assert client is not None and client.model == "m"
    # Settings are reported and hashed: the key is none of them.
    assert llm_secret not in repr(cfg) and llm_secret not in str(cfg.code_options())
    assert all(llm_secret not in str(row) for row in config_mod.Config.describe())


def test_redact_removes_the_key_and_its_echoed_ends(llm_secret):
    text = f"a {llm_secret} b {llm_secret[:8]}...{llm_secret[-8:]}"
    out = redact(text, llm_secret)
    assert llm_secret not in out and llm_secret[:8] not in out and llm_secret[-8:] not in out
    assert redact("plain", "") == "plain"
