"""A stand-in for the external `vllm` executable: `fake_vllm.py serve MODEL --host H --port P ...` answers vLLM's admin
and readiness routes over real HTTP and appends every call to the JSON-lines file named by FAKE_VLLM_CALLS.

Standard library only, so that it starts in milliseconds. Like vLLM, it mounts the dev routes only with
VLLM_SERVER_DEV_MODE=1, the LoRA routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, and checks the bearer token
(VLLM_API_KEY) on /v1 paths only. It forks one idle child, as vLLM forks its engine core, whose pid it records.

`POST /v1/chat/completions` answers a model it serves (its served name, or a loaded adapter's) with one fixed
token, naming that model, as vLLM does; any other model gets vLLM's 404.

Knobs (environment): FAKE_VLLM_EXIT_CODE=N prints an error and exits with N before serving; FAKE_VLLM_READY_AFTER=S
answers /health with 503 for S seconds; FAKE_VLLM_IGNORE_SIGTERM=1 ignores SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

CALLS_PATH = os.environ.get("FAKE_VLLM_CALLS")
DEV_MODE = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
LORA_UPDATES = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
API_KEY = os.environ.get("VLLM_API_KEY")
_lock = threading.Lock()


def record(entry: dict) -> None:
    if CALLS_PATH is None:
        return
    with _lock, open(CALLS_PATH, "a") as f:
        f.write(json.dumps(entry) + "\n")


class State:
    ready_at = 0.0
    served_name = ""
    sleeping = False
    adapters: dict[str, str] = {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        sys.stdout.write(f"fake-vllm: {format % args}\n")
        sys.stdout.flush()

    def _answer(self, status: int, body: object | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        record({"method": method, "path": url.path, "query": query, "body": body})
        if url.path.startswith("/v1") and API_KEY and self.headers.get("Authorization") != f"Bearer {API_KEY}":
            return self._answer(401, {"error": "Unauthorized"})
        route = (method, url.path)
        dev_routes = {("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/collective_rpc")}
        dev_routes.add(("POST", "/reset_prefix_cache"))
        lora_routes = {("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")}
        if (route in dev_routes and not DEV_MODE) or (route in lora_routes and not LORA_UPDATES):
            return self._answer(404, {"detail": "Not Found"})
        if route == ("GET", "/health"):
            return self._answer(200 if time.monotonic() >= State.ready_at else 503)
        if route == ("GET", "/v1/models"):
            names = [State.served_name, *State.adapters]
            return self._answer(200, {"object": "list", "data": [{"id": name, "object": "model"} for name in names]})
        if route == ("POST", "/sleep"):
            State.sleeping = True
            return self._answer(200)
        if route == ("POST", "/wake_up"):
            State.sleeping = False
            return self._answer(200)
        if route == ("GET", "/is_sleeping"):
            return self._answer(200, {"is_sleeping": State.sleeping})
        if route == ("POST", "/collective_rpc"):
            if not body or "method" not in body:
                return self._answer(400, {"detail": "Missing 'method' in request body"})
            return self._answer(200, {"results": [None]})
        if route == ("POST", "/reset_prefix_cache"):
            return self._answer(200, {"success": True})
        if route == ("POST", "/v1/load_lora_adapter"):
            name = body["lora_name"]
            if name in State.adapters:
                return self._answer(400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}})
            State.adapters[name] = body["lora_path"]
            return self._answer(200)
        if route == ("POST", "/v1/unload_lora_adapter"):
            if State.adapters.pop(body["lora_name"], None) is None:
                return self._answer(404, {"error": {"message": "not found"}})
            return self._answer(200)
        if route == ("POST", "/v1/chat/completions"):
            return self._chat(body or {})
        return self._answer(404, {"detail": "Not Found"})

    def _chat(self, body: dict) -> None:
        model = body.get("model")
        if model not in (State.served_name, *State.adapters):
            message = f"The model `{model}` does not exist."
            return self._answer(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
        choice = {
            "index": 0, "message": {"role": "assistant", "content": "d"}, "finish_reason": "stop", "token_ids": [7],
            "logprobs": {"content": [{"token": "d", "logprob": -0.5}]},
        }  # fmt: skip
        usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
        answer = {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": model}
        return self._answer(200, {**answer, "choices": [choice], "prompt_token_ids": [5, 6], "usage": usage})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name")
    args, _ = parser.parse_known_args()

    if os.environ.get("FAKE_VLLM_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_code = int(os.environ.get("FAKE_VLLM_EXIT_CODE", "0"))
    if exit_code:
        print(f"ValueError: fake vllm cannot load {args.model}", flush=True)
        sys.exit(exit_code)

    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record(
        {
            "event": "start",
            "pid": os.getpid(),
            "engine_pid": engine.pid,
            "argv": sys.argv[1:],
            "env": {key: os.environ.get(key) for key in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")},
            "api_key_set": API_KEY is not None,
        }
    )
    State.served_name = args.served_model_name or args.model
    State.ready_at = time.monotonic() + float(os.environ.get("FAKE_VLLM_READY_AFTER", "0"))
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake vllm serving {State.served_name} on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
