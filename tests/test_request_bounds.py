"""Bad and oversized requests against real servers on 127.0.0.1: each server answers a 4xx in its own error shape,
reads no more of a body than its limit (declared or chunked), forwards nothing it refused, and stays up."""

from __future__ import annotations

import logging
import shutil
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from support.fixed_backend import FixedBackend
from support.servers import serving
from transformers import AutoTokenizer

from lightning.inference import create_inference_app
from lightning.proxy import LLMProxy
from lightning.proxy.capture import Call, Choice
from lightning.proxy.continuation import Conversations
from lightning.store.agl_routes import PREFIX, ROUTES
from lightning.store.server import create_app
from lightning.store.sql import SqlLightningStore

LIMIT = 10_000


@pytest.fixture
async def sql_store(tmp_path: Path) -> AsyncIterator[SqlLightningStore]:
    store = SqlLightningStore(f"sqlite:///{tmp_path / 'store.db'}", watchdog_interval=None)
    yield store
    await store.close()


def answer_to_an_unfinished_chunked_body(url: str, path: str, chunks: int = 4, size: int = 64 * 1024) -> int:
    """Send `chunks` chunks of a chunked body (more than the limit) and never its end; the status the server answers
    meanwhile. A server that read the body whole before judging it would never answer (a timeout here)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
        for _ in range(chunks):
            sock.sendall(f"{size:x}\r\n".encode() + b" " * size + b"\r\n")
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1])


def test_every_agl_post_route_answers_400_to_a_body_that_is_not_utf8(sql_store: SqlLightningStore) -> None:
    posts = [route for route in ROUTES if route.method == "POST"]
    with serving(create_app(sql_store)) as url, httpx.Client() as http:  # one client: each new one costs ~50 ms
        for route in posts:
            path = route.path.replace("{rollout_id}", "ro-x").replace("{attempt_id}", "at-x")
            path = path.replace("{worker_id}", "w").replace("{resources_id}", "rs-x")
            for body in (b'"\xe9"', b'{"input": "\xff\xfe"}'):
                answer = http.post(url + PREFIX + path, content=body, headers={"content-type": "application/json"})
                assert answer.status_code == 400, (route.path, answer.status_code, answer.text)
                assert "not UTF-8" in answer.json()["detail"]
        assert len(posts) >= 13
        assert http.get(url + "/health").status_code == 200


def test_the_store_refuses_a_large_body_declared_or_chunked_while_reading_it(
    sql_store: SqlLightningStore, caplog: pytest.LogCaptureFixture
) -> None:
    with serving(create_app(sql_store, max_body_bytes=LIMIT)) as url:
        for path in ("/v1/store/enqueue_rollout", PREFIX + "/rollouts", "/v1/traces"):
            # 256 KiB sent of a body that never ends, against a 10,000-byte limit: refused while reading.
            assert answer_to_an_unfinished_chunked_body(url, path) == 413, path
        for path in ("/v1/store/enqueue_rollout", PREFIX + "/rollouts"):
            answer = httpx.post(url + path, json={"input": "x" * 2 * LIMIT})
            assert answer.status_code == 413, path
            assert "at most 10,000 bytes" in answer.json()["detail"] and "--max-body-mb" in answer.json()["detail"]
        # A chunked body that does end (httpx sends a generator chunked), over the limit: 413, and the store is fine.
        chunks = (b"x" * 4096 for _ in range(8))
        answer = httpx.post(url + PREFIX + "/rollouts", content=chunks, headers={"content-type": "application/json"})
        assert answer.status_code == 413 and "is over" in answer.json()["detail"]
        assert httpx.post(url + "/v1/store/enqueue_rollout", json={"input": "x"}).status_code == 200
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]  # a refusal is no error


def test_the_proxy_refuses_a_large_body_before_forwarding_it(sql_store: SqlLightningStore) -> None:
    backend = FixedBackend()
    with serving(backend) as backend_url:
        proxy = LLMProxy(sql_store, [backend_url + "/v1"], max_body_bytes=LIMIT)
        url = proxy.start()
        try:
            big = {"model": "policy", "messages": [{"role": "user", "content": "x" * 2 * LIMIT}]}
            answer = httpx.post(url + "/v1/chat/completions", json=big)
            assert answer.status_code == 413
            assert "at most 10,000 bytes" in answer.json()["error"]["message"]
            assert "inference.max_request_mb" in answer.json()["error"]["message"]
            assert answer_to_an_unfinished_chunked_body(url, "/v1/chat/completions") == 413
            assert backend.requests == []  # nothing refused reached the backend
            small = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(url + "/v1/chat/completions", json=small).status_code == 200
        finally:
            proxy.stop()


def test_the_inference_server_bounds_bodies_and_refuses_long_prompts_before_tokenizing(tiny_dir: Path) -> None:
    app = create_inference_app(tiny_dir, served_model_name="policy", max_body_bytes=1_000_000)
    engine = app.state.engine
    engine.start()
    try:
        with serving(app) as url:
            chat = f"{url}/v1/chat/completions"
            huge = {"model": "policy", "messages": [{"role": "user", "content": "x" * 2_000_000}]}
            answer = httpx.post(chat, json=huge, timeout=60)
            assert answer.status_code == 413 and answer.json()["error"]["type"] == "RequestTooLarge"
            assert "inference.max_request_mb" in answer.json()["error"]["message"]
            assert answer_to_an_unfinished_chunked_body(url, "/v1/chat/completions", chunks=20) == 413
            # Under the body limit but far over the context (512 tokens): refused by its length, not tokenized.
            long = {"model": "policy", "messages": [{"role": "user", "content": "ab " * 300_000}]}
            started = time.perf_counter()
            answer = httpx.post(chat, json=long, timeout=60)
            seconds = time.perf_counter() - started
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
            assert "at least" in answer.json()["error"]["message"], answer.text
            prompt = {"model": "policy", "prompt": "ab " * 300_000, "max_tokens": 1}
            answer = httpx.post(f"{url}/v1/completions", json=prompt, timeout=60)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
            ok = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(chat, json=ok, timeout=60).status_code == 200
            assert seconds < 30  # generous for a loaded machine; tokenizing first took 9.5 s for 5 MB
    finally:
        engine.stop()


def test_a_long_prompt_is_refused_by_a_prefix_where_the_vocabulary_has_long_tokens(
    tiny_dir: Path, tmp_path: Path
) -> None:
    # Real vocabularies have tokens of 128 characters (GPT-4's, Qwen's), so the length bound (context x the longest
    # token) lets megabytes through on a large context. Here: the tiny model with one 2,000-character token, so
    # the bound is 512 x 2,002 characters; a 600,000-character prompt passes it, and is refused by a prefix.
    model_dir = tmp_path / "long-token"
    shutil.copytree(tiny_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_tokens(["<" + "long" * 500 + ">"])
    tokenizer.save_pretrained(model_dir)
    app = create_inference_app(model_dir, served_model_name="policy")
    assert app.state.engine.max_token_chars == 2002
    with serving(app) as url:
        long = {"model": "policy", "messages": [{"role": "user", "content": "ab " * 200_000}]}
        answer = httpx.post(f"{url}/v1/chat/completions", json=long, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
        message = answer.json()["error"]["message"]
        assert "600,0" in message and "alone are" in message, message  # refused by a prefix, not tokenized whole
        assert int(message.split("its first ")[1].split(" ")[0].replace(",", "")) < 20_000
        prompt = {"model": "policy", "prompt": "ab " * 200_000, "max_tokens": 1}
        answer = httpx.post(f"{url}/v1/completions", json=prompt, timeout=60)
        assert answer.status_code == 400 and "alone are" in answer.json()["error"]["message"]


def test_the_proxy_does_not_tokenize_a_continuation_too_long_for_the_context(tiny_dir: Path) -> None:
    # A call that continues an earlier one of its attempt is joined token-exactly by the proxy, which renders and
    # tokenizes the conversation: a 6 MB new message took it 22 s and 1.5 GB. Now the proxy leaves such a call to
    # the server (which refuses it by its length) and says why on the span.
    conversations = Conversations(tiny_dir)  # the context from the model's config.json
    attempt, first = ("ro-1", "at-1"), [{"role": "user", "content": "hi"}]
    end_of_turn = AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids("<|im_end|>")
    call = Call("chat", {"messages": first}, stream=False, status_code=200, prompt_token_ids=[1, 2, 3])
    call.choices[0] = Choice(text_parts=["yo"], token_ids=[5, end_of_turn])
    conversations.remember(attempt, {"messages": first}, call)
    assert conversations.fits == (512, 13)
    history = [*first, {"role": "assistant", "content": "yo"}]
    short = conversations.prompt_for(attempt, {"messages": [*history, {"role": "user", "content": "and?"}]})
    assert short.prompt_ids is not None and short.prompt_ids[:5] == [1, 2, 3, 5, end_of_turn]  # joined
    long = {"messages": [*history, {"role": "user", "content": "hello world " * 500_000}]}
    refused = conversations.prompt_for(attempt, long)
    assert refused.prompt_ids is None and refused.continues
    assert refused.reason is not None and "at least" in refused.reason and "context is 512" in refused.reason


def test_the_limit_is_a_setting_of_the_run() -> None:
    from lightning.config import TrainConfig

    assert TrainConfig(agent="examples.copy_task.agent:copy_agent").inference.max_request_mb == 32
    with pytest.raises(ValueError, match="max_request_mb"):
        TrainConfig(agent="examples.copy_task.agent:copy_agent", inference={"max_request_mb": 0})
