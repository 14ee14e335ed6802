"""agent-lightning's `LLMProxy` (its `agentlightning.llm_proxy`), by its name and arguments, over our LLM proxy
(lightning.proxy.LLMProxy): a proxy in front of models that stores each call as a span of the rollout attempt whose
route it came by (`/rollout/<rollout_id>/attempt/<attempt_id>/v1/...`).

agl's `model_list` is LiteLLM's: `{"model_name": name, "litellm_params": {"model": ..., "api_base": ...}}`.

- `hosted_vllm/<model>` at an `api_base` (a vLLM server, or our inference server) is a backend of ours: the proxy
  asks it for token ids and log-probs and stores them on the span, as agl's `return_token_ids` callback does, so
  these calls train. All such entries must share one `model_name` (the name agents ask for); several entries are
  several replicas of it.
- any other LiteLLM model (`openai/gpt-4.1-mini`, ...) is called through LiteLLM's Router (spans, no token ids).

    store = InMemoryLightningStore()
    proxy = LLMProxy(port=43886, model_list=[{"model_name": "qwen", "litellm_params": {
        "model": "hosted_vllm/Qwen/Qwen2.5-0.5B-Instruct", "api_base": "http://127.0.0.1:8000/v1"}}], store=store)
    await proxy.start()
    llm = proxy.as_resource(rollout.rollout_id, rollout.attempt.attempt_id)   # an LLM on the attempt's route
    ...
    await proxy.stop()

It serves on a thread of this process whatever `launch_mode` says (our proxy has no tracer provider to keep apart
from the agent's). Refused, with why: `num_workers` other than 1, `launcher_args`, `litellm_config`, middlewares and
callbacks other than agl's defaults (ours routes by rollout and attempt, records streams, token ids and log-probs
itself). `num_retries` is how many more backends a failed call tries. It listens on loopback unless `host` is given
with `token=` (agents then send the token as their API key).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.types import LLM, ProxyLLM

logger = logging.getLogger(__name__)

HOSTED_VLLM = "hosted_vllm/"
_OUR_MIDDLEWARES = {"rollout_attempt", "stream_conversion", "message_inspection"}
_OUR_CALLBACKS = {"return_token_ids", "opentelemetry", "logprobs"}

ModelConfig = dict[str, Any]
"""agl's name for one entry of `model_list` (LiteLLM's shape)."""


class LLMProxy:
    """agl's `LLMProxy(port=, model_list=, store=, host=, ...)`; `start()` / `stop()` / `restart()` (async),
    `is_running()`, `update_model_list(...)`, `as_resource(rollout_id, attempt_id, model=)`, `get_store()` /
    `set_store()`. The proxy of ours behind it is `proxy` once started."""

    def __init__(
        self,
        port: int | None = None,
        model_list: Sequence[Mapping[str, Any]] | None = None,
        store: Any = None,
        host: str | None = None,
        litellm_config: Mapping[str, Any] | None = None,
        num_retries: int = 0,
        num_workers: int = 1,
        launch_mode: str = "mp",
        launcher_args: Any = None,
        middlewares: Sequence[Any] | None = None,
        callbacks: Sequence[Any] | None = None,
        *,
        token: str | None = None,
    ) -> None:
        if num_workers != 1 or launcher_args is not None:
            raise ValueError(
                "LLMProxy: one proxy serves on a thread of this process here (num_workers=1, no launcher_args); "
                "for a proxy process of its own, run `lightning proxy serve`"
            )
        if litellm_config:
            raise ValueError(
                "LLMProxy(litellm_config=...): the proxy here is not LiteLLM's; put each model's LiteLLM settings "
                "in its model_list entry's litellm_params"
            )
        aliases = (("middlewares", middlewares, _OUR_MIDDLEWARES), ("callbacks", callbacks, _OUR_CALLBACKS))
        for kind, given, ours in aliases:
            unknown = [item for item in (given or []) if item not in ours]
            if unknown:
                raise ValueError(
                    f"LLMProxy({kind}={unknown!r}): the proxy here routes calls by rollout and attempt, records "
                    "streams, token ids and log-probs itself; only agl's own aliases are taken "
                    f"({sorted(ours)}), and they change nothing"
                )
        if launch_mode not in ("mp", "thread", "asyncio"):
            raise ValueError(f"LLMProxy: launch_mode must be 'mp', 'thread' or 'asyncio', got {launch_mode!r}")
        self.port = port
        self.host = host
        self.store = store
        self.num_retries = num_retries
        self.launch_mode = launch_mode
        self.token = token
        self.proxy: Any = None
        self.model_list: list[dict[str, Any]] = []
        self.update_model_list(model_list or [])

    # --- agl's configuration calls ---

    def get_store(self) -> Any:
        return self.store

    def set_store(self, store: Any) -> None:
        self.store = store

    def update_model_list(self, model_list: Sequence[Mapping[str, Any]]) -> None:
        """Replace the models; a running proxy takes the new vLLM backends at once (external models on restart)."""
        entries = [dict(entry) for entry in model_list]
        for entry in entries:
            if not isinstance(entry.get("model_name"), str) or not isinstance(entry.get("litellm_params"), Mapping):
                raise ValueError(f"LLMProxy: a model_list entry needs model_name and litellm_params, got {entry!r}")
        hosted = {entry["model_name"] for entry in entries if _is_hosted_vllm(entry)}
        if len(hosted) > 1:
            raise ValueError(
                f"LLMProxy: the hosted_vllm models have several names {sorted(hosted)}; one proxy here serves one "
                "model (its backends are replicas of it): start a proxy per model"
            )
        self.model_list = entries
        if self.proxy is not None:
            self.proxy.set_backends(self._backends())

    # --- serving ---

    def is_running(self) -> bool:
        return self.proxy is not None

    async def start(self) -> None:
        """Serve on a thread of this process; returns once it listens at `endpoint`."""
        from lightning.proxy import ExternalModel
        from lightning.proxy import LLMProxy as OurProxy

        if self.store is None:
            raise ValueError("LLMProxy: no store: give store= or call set_store(store) before start()")
        if self.proxy is not None:
            raise RuntimeError("LLMProxy: it is running already (restart() restarts it)")
        hosted = [entry["model_name"] for entry in self.model_list if _is_hosted_vllm(entry)]
        external = [
            ExternalModel(model_name=entry["model_name"], litellm_params=dict(entry["litellm_params"]))
            for entry in self.model_list
            if not _is_hosted_vllm(entry)
        ]
        options: dict[str, Any] = {"model_name": hosted[0]} if hosted else {}
        proxy = OurProxy(
            self.store,
            self._backends(),
            external_models=external,
            token=self.token,
            agents_need_token=self.token is not None,
            max_tries=self.num_retries + 1,
            **options,
        )
        await asyncio.to_thread(proxy.start, self.host or "127.0.0.1", self.port or 0)
        self.proxy = proxy
        logger.info("LLMProxy serving %s at %s", [entry["model_name"] for entry in self.model_list], proxy.url)

    async def stop(self) -> None:
        """Stop serving (the store stays open)."""
        proxy, self.proxy = self.proxy, None
        if proxy is None:
            logger.warning("LLMProxy is not running; nothing to stop")
            return
        await asyncio.to_thread(proxy.stop)

    async def restart(self, *, _port: int | None = None) -> None:
        if self.proxy is not None:
            await self.stop()
        if _port is not None:
            self.port = _port
        await self.start()

    @property
    def endpoint(self) -> str:
        """Where agents reach it (http://host:port)."""
        if self.proxy is None or self.proxy.url is None:
            raise RuntimeError("LLMProxy: not running; call await proxy.start() first")
        return str(self.proxy.url)

    def as_resource(
        self,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        model: str | None = None,
        sampling_parameters: Mapping[str, Any] | None = None,
    ) -> LLM:
        """An LLM resource on this proxy: with a rollout and an attempt, on that attempt's route; without, a
        `ProxyLLM` that a runner routes to each attempt. `model`: the one name of model_list when left out."""
        if model is None:
            names = {entry["model_name"] for entry in self.model_list}
            if len(names) != 1:
                raise ValueError(f"LLMProxy.as_resource: model_list has {len(names)} model names; give model=")
            model = names.pop()
        if (rollout_id is None) != (attempt_id is None):
            raise ValueError("LLMProxy.as_resource: give both rollout_id and attempt_id, or neither")
        resource = ProxyLLM(
            endpoint=f"{self.endpoint}/v1",
            model=model,
            sampling_parameters=dict(sampling_parameters or {}),
            api_key=self.token,
        )
        if rollout_id is None:
            return resource
        return resource.with_attempted_rollout_ids(rollout_id, attempt_id)  # type: ignore[arg-type]

    def _backends(self) -> list[Any]:
        from lightning.proxy import Backend

        return [
            Backend(
                url=str(entry["litellm_params"].get("api_base") or ""),
                model=str(entry["litellm_params"]["model"]).removeprefix(HOSTED_VLLM),
                api_key=entry["litellm_params"].get("api_key"),
            )
            for entry in self.model_list
            if _is_hosted_vllm(entry)
        ]


def _is_hosted_vllm(entry: Mapping[str, Any]) -> bool:
    model = entry["litellm_params"].get("model")
    if isinstance(model, str) and model.startswith(HOSTED_VLLM):
        if not entry["litellm_params"].get("api_base"):
            raise ValueError(f"LLMProxy: {entry['model_name']!r} ({model}) needs litellm_params api_base (its URL)")
        return True
    return False


__all__ = ["LLMProxy", "ModelConfig"]
