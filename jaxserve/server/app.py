"""The HTTP side of the server: the aiohttp application (routes, error and auth middleware), the endpoints, the choice
of model per request, and `serve` (run until SIGTERM, then drain). See jaxserve.server."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jaxserve.cascade.policy import CascadeConfig
from jaxserve.engine.client import EngineClient, EngineDeadError
from jaxserve.openai.answer_size import DEFAULT_MAX_LOGPROB_ENTRIES, LogprobLimits
from jaxserve.openai.chat_messages import chat_template_kwargs, render_chat
from jaxserve.openai.errors import ApiError
from jaxserve.openai.http import (
    DISCARD_PATH,
    KV_TRANSFER_FIELD,
    api_key_auth,
    drain,
    errors,
    json_body,
    run_until_signalled,
)
from jaxserve.openai.kv_transfer_params import KVTransferParams
from jaxserve.openai.metrics import ServerMetrics
from jaxserve.openai.requests import grammar_error, parse_chat, parse_completion, wants_usage_in_stream
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.server import disaggregated, messages, tokenizer_routes
from jaxserve.server.cascade import ServedCascade
from jaxserve.server.disaggregated import PrefillSide
from jaxserve.server.kv_trust import KVTrust
from jaxserve.server.lora_modules import LoRAModules, ServedAdapter
from jaxserve.server.responses import CompletionResponse, merged
from jaxserve.server.responses_api import DEFAULT_STORE_SIZE, ResponsesRoutes
from jaxserve.server.served_model import AutoTools, ServedModel

logger = logging.getLogger("jaxserve")


class Server:
    """Server(engine, model_name, ...) serves one engine; Server({model_name: engine, ...}, ...) several, the first
    being the default for requests that name no model. The other arguments apply to each engine (tokenizer_threads:
    the threads each model tokenizes and renders chat templates on; allow_runtime_lora_updating: vLLM's
    /v1/load_lora_adapter and /v1/unload_lora_adapter, off by default as there). Adapters: `lora` (LoRAModules).
    cascade: a CascadeConfig over served models, whose name requests may give as their model (`cascade`).
    max_logprobs, max_logprob_entries: how large one answer's logprobs may be (jaxserve.openai.answer_size).
    auto_tools: tool_choice auto (--enable-auto-tool-choice, --tool-call-parser: jaxserve.server.served_model).
    reasoning_parser: vLLM's --reasoning-parser (jaxserve.openai.reasoning), for every model.
    responses_store_size: the responses /v1/responses keeps for previous_response_id and GET (responses_store)."""

    def __init__(self, engine: EngineClient | dict[str, EngineClient], model_name: str | None = None, *,
                 api_key: str | None = None, max_queued_requests: int = 256, max_request_sequences: int | None = None,
                 stream_write_timeout_s: float = 30.0, header_timeout_s: float = 10.0, body_timeout_s: float = 30.0,
                 tokenizer_threads: int = 2, allow_runtime_lora_updating: bool = False,
                 prefill_side: PrefillSide | None = None, kv_fetch_timeout_s: float = 30.0,
                 kv_trust: KVTrust | None = None, cascade: CascadeConfig | None = None,
                 max_logprobs: int = MAX_LOGPROBS, max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
                 auto_tools: AutoTools | None = None, reasoning_parser: str | None = None,
                 responses_store_size: int = DEFAULT_STORE_SIZE):
        if isinstance(engine, dict):
            if model_name is not None:
                raise TypeError("with several engines ({name: engine}) the names are the dict's keys: no model_name")
            engines = engine
        else:
            if model_name is None:
                raise TypeError("Server(engine, model_name): a single engine needs its model name")
            engines = {model_name: engine}
        if not engines or not all(isinstance(name, str) and name for name in engines):
            raise ValueError("a server needs at least one engine, each under a non-empty name")
        self.auth = api_key_auth(api_key, tokenizer_routes.PATHS)  # /v1/ and these: by API key, if given one
        self.metrics = ServerMetrics()
        limits = LogprobLimits(max_logprobs, max_logprob_entries)
        self.models = {name: ServedModel(name, e, self.metrics.add_model(name, e.stats), max_queued_requests,
                                         max_request_sequences, tokenizer_threads, limits, auto_tools,
                                         reasoning_parser)
                       for name, e in engines.items()}
        self.default = next(iter(self.models.values()))
        self.cascade = ServedCascade(cascade, self.models, self.metrics) if cascade is not None else None
        self.lora = LoRAModules(self.models, reserved={cascade.name} if cascade is not None else set())
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.stream_write_timeout_s = stream_write_timeout_s
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self.draining = False
        # Disaggregated prefill (--role prefill|decode: see jaxserve.server.disaggregated): one model, one role.
        self.role = self.default.engine.role
        if self.role != "both" and len(self.models) > 1:
            raise ValueError(f"a {self.role} server (--role {self.role}) serves one model")
        if self.role != "prefill" and prefill_side is not None:
            raise ValueError("a KV transfer port is a prefill server's (--role prefill)")
        self.prefill_side = prefill_side or (PrefillSide(trust=kv_trust) if self.role == "prefill" else None)
        # Whom kv_transfer_params are trusted from (a prefill server's is its prefill_side's: its KV port uses it).
        self.kv_trust = self.prefill_side.trust if self.prefill_side is not None else (kv_trust or KVTrust())
        self.kv_fetch_timeout_s = kv_fetch_timeout_s
        self.responses = ResponsesRoutes(self, responses_store_size)  # /v1/responses, its stored answers

    @property
    def in_flight(self) -> int:
        """Sequences admitted and not finished, over every model."""
        return sum(m.in_flight for m in self.models.values())

    def engines(self) -> list[EngineClient]:
        return [m.engine for m in self.models.values()]

    def app(self) -> web.Application:
        # aiohttp closes a connection whose next request head is not complete within keepalive_timeout of its
        # opening or of the previous response (idle keep-alive connections alike): that is the header timeout.
        app = web.Application(middlewares=[errors, messages.errors, self.auth],
                              handler_args={"keepalive_timeout": self.header_timeout_s})
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        messages.add_routes(app, self)  # Anthropic's /v1/messages
        self.responses.add_routes(app)  # OpenAI's /v1/responses
        tokenizer_routes.add_routes(app, self)  # vLLM's (lm-evaluation-harness's remote tokenizer reads them)
        if self.allow_runtime_lora_updating:  # else 404s, as vLLM's without VLLM_ALLOW_RUNTIME_LORA_UPDATING
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        if self.prefill_side is not None:
            app.cleanup_ctx.append(self._kv_server)
            app.router.add_delete(DISCARD_PATH + "/{transfer_id}", self.discard_kv_transfer)
        return app

    async def _kv_server(self, app):
        """A prefill server's KVServer, in the application's event loop for its life."""
        await self.prefill_side.start()
        yield
        await self.prefill_side.close()

    # ---- plain endpoints ----

    async def discard_kv_transfer(self, request):
        """The router's word that a transfer will not be fetched (its decode failed before the fetch): its pages go
        now, not at the end of their TTL."""
        transfer_id = request.match_info["transfer_id"]
        return web.json_response({"transfer_id": transfer_id,
                                  "discarded": self.prefill_side.store.discard(transfer_id)})

    async def health(self, request):
        """200 while every engine serves; "degraded" (still 200: requests are served) names the models with stopped
        data-parallel replicas."""
        alive = all(m.engine.alive() for m in self.models.values()) and not self.draining
        if not alive:
            return web.json_response({"status": "unavailable"}, status=503)
        snapshots = {name: m.engine.stats() for name, m in self.models.items()}
        stopped = {name: s.num_replicas - s.num_replicas_healthy for name, s in snapshots.items()
                   if s.num_replicas_healthy < s.num_replicas}
        if stopped:
            return web.json_response({"status": "degraded", "stopped_replicas": stopped})
        return web.json_response({"status": "ok"})

    async def prometheus(self, request):
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, request):
        """The served models, then the adapters (as vLLM: root is the adapter's path, parent its base model), then
        the cascade (root: its tiers, comma-separated; its max_model_len its last tier's, which answers whatever
        reaches it)."""
        created = int(time.time())

        def card(name: str, m: ServedModel, root, parent) -> dict:
            return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve", "root": root,
                    "parent": parent, "max_model_len": m.engine.max_model_len}
        return web.json_response({"object": "list", "data": [
            *(card(m.name, m, m.engine.model_path or m.name, None) for m in self.models.values()),
            *(card(a.name, a.model, a.lora_request.lora_path, a.model.name) for a in self.lora.adapters.values()),
            *([card(self.cascade.name, self.cascade.surely_taking(), ",".join(self.cascade.names), None)]
              if self.cascade is not None else [])]})

    # ---- LoRA adapters at run time (vLLM's endpoints and answers) ----

    async def load_lora_adapter(self, request):
        body = await self._body(request)
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        name = body.get("lora_name")
        await self.lora.load(name, body.get("lora_path"), body.get("base_model_name"))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request):
        body = await self._body(request)
        name = body.get("lora_name")
        await self.lora.unload(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # ---- generation ----

    async def completions(self, request):
        body = await self._body(request)
        if self._cascade_named(body):
            return await self.cascade.completions(self, request, body, chat=False)
        kv_params = disaggregated.take_params(body, self.role, self.kv_trust)
        m, adapter = self._target(body)
        prompts, params = parse_completion(body)
        m.logprob_limits.check_counts(params, chat=False)
        m.fits_prompts(prompts, params)
        seqs = params.n * len(prompts)
        if kv_params is not None:
            disaggregated.one_sequence(seqs)
        with self._admitted(m, seqs):
            prompts = await self.completion_prompts(m, prompts, params, seqs)
            return await self._generate(m, adapter, request, body, prompts, params, chat=False, kv_params=kv_params)

    async def completion_prompts(self, m: ServedModel, prompts: list, params, seqs: int) -> list[dict]:
        """The prompts tokenized for model m (within its admission of `seqs`)."""
        # Off the event loop: a 1 MiB prompt takes a while to tokenize, and everyone else must still be served.
        return await m.off_loop(seqs, lambda: [m.tokenized(p, params) for p in prompts])

    async def chat_completions(self, request):
        body = await self._body(request)
        if self._cascade_named(body):
            return await self.cascade.completions(self, request, body, chat=True)
        kv_params = disaggregated.take_params(body, self.role, self.kv_trust)
        m, adapter = self._target(body)
        m.check_chat()
        messages, params, tools = parse_chat(body)
        if kv_params is not None:
            disaggregated.one_sequence(params.n)
            if tools is not None:  # the decode side's parser would not see the first token's text
                raise ApiError(400, "tool calls are not supported with disaggregated prefill yet", "tools")
        params = m.chat_params(params, tools)
        m.logprob_limits.check_counts(params, chat=True)
        with self._admitted(m, params.n):
            prompt = await self.chat_prompt(m, messages, params, tools, template_kwargs=chat_template_kwargs(body))
            return await self._generate(m, adapter, request, body, [prompt], params, chat=True, tools=tools,
                                        kv_params=kv_params)

    async def chat_prompt(self, m: ServedModel, messages: list[dict], params, tools, seqs: int | None = None,
                          template_kwargs: dict | None = None) -> dict:
        """The conversation rendered by model m's chat template (with the request's chat_template_kwargs) and
        tokenized (within its admission of `seqs`, params.n unless given: a cascade's scoring pass holds one)."""
        # Off the event loop too: the template renders the conversation, then it is refused by its length or
        # tokenized.
        return await m.off_loop(params.n if seqs is None else seqs, lambda: m.tokenized(
            render_chat(messages, m.tokenizer, tools, template_kwargs), params, add_special_tokens=False))

    async def _body(self, request) -> dict:
        return await json_body(request, self.body_timeout_s)

    def _cascade_named(self, body) -> bool:
        """Whether the request names the cascade (routed by it rather than sent to one model)."""
        return (self.cascade is not None and isinstance(body, dict)
                and isinstance(body.get("model"), str) and body["model"] == self.cascade.name)

    def _target(self, body: dict) -> tuple[ServedModel, ServedAdapter | None]:
        """The engine the request's `model` names (none: the default one), and the adapter if it names one (the
        engine is then the adapter's base). The cascade's name (tokenizer endpoints): its tiers' shared tokenizer."""
        name = body.get("model")
        if name is None:
            return self.default, None
        if not isinstance(name, str):
            raise ApiError(400, f"model must be a string, got {type(name).__name__}", "model")
        m = self.models.get(name)
        if m is not None:
            return m, None
        if self._cascade_named(body):
            assert self.cascade is not None  # _cascade_named found it
            return self.cascade.tokenizing_model(), None
        adapter = self.lora.get(name)
        if adapter is not None:
            return adapter.model, adapter
        # OpenAI's answer: 404, invalid_request_error, code model_not_found
        served = ", ".join(f"`{n}`" for n in [*self.models, *self.lora.adapters,
                                              *([self.cascade.name] if self.cascade is not None else [])])
        raise ApiError(404, f"The model `{name}` does not exist; this server serves {served}", "model",
                       "model_not_found")

    def chat_built_target(self, body: dict, route: str) -> tuple[ServedModel, ServedAdapter | None]:
        """The model (and adapter) a request of another API built on the chat path (Messages, Responses) names:
        served by neither a role server nor the cascade (a 400 naming `route`)."""
        if self.role != "both":
            raise ApiError(400, f"a {self.role} server (--role {self.role}) serves chat and completions, not {route}")
        if self._cascade_named(body):
            raise ApiError(400, f"the cascade serves chat and completions, not {route}", "model")
        m, adapter = self._target(body)
        m.check_chat()
        return m, adapter

    @contextlib.contextmanager
    def _admitted(self, m: ServedModel, seqs: int):
        """Holds `seqs` of the model's capacity for the block, or refuses the request (503 while draining): checked
        before anything costly."""
        if self.draining:
            raise ApiError(503, "the server is shutting down")
        with m.admitted(seqs):
            yield

    async def _generate(self, m: ServedModel, adapter: ServedAdapter | None, request, body, prompts: list, params,
                        chat: bool, tools=None, kv_params: KVTransferParams | None = None):
        """prompts: tokenized, one engine request each (a completions batch); choice k * n + i is prompt k's i-th
        sample. kv_params: a role server's (checked) kv_transfer_params. Runs within _admitted. (A cascade's
        answering tier comes here as a model of its own.)"""
        stream = body.get("stream") is True
        if stream and self.role == "prefill":
            raise ApiError(400, "a prefill server answers whole (stream: false): the decode server streams", "stream")
        include_usage = wants_usage_in_stream(body)
        # The answer names the model asked for (an adapter: its name, as vLLM's).
        run = CompletionResponse(m, body, params, chat, len(prompts), self.stream_write_timeout_s, tools,
                                 adapter.name if adapter is not None else m.name)
        # Base-model requests pass no lora_request: the engine's own default (an engine without LoRA takes none).
        lora: dict[str, Any] = {"lora_request": adapter.lora_request} if adapter is not None else {}
        if self.role == "prefill":
            assert self.prefill_side is not None  # a prefill server always has one
            self.prefill_side.check_room()
        if self.role == "decode":  # the pages first: a failed fetch adds nothing
            # A decode server's checked params always name the pages (KVTransferParams.for_role).
            assert kv_params is not None and kv_params.remote is not None
            disaggregated.check_prompt(kv_params.remote, prompts[0]["prompt_token_ids"], m.engine.vocab_size)
            # A prefill server claiming more bytes than the prompt's pages take here is refused before any allocation.
            most = m.engine.pages_bytes(len(prompts[0]["prompt_token_ids"]))
            prefilled, run.headers = await disaggregated.fetch_prefilled(kv_params.remote, self.kv_fetch_timeout_s,
                                                                         most, self.kv_trust)
            lora["prefilled"] = prefilled
        async with self.running(m, adapter, run, body, prompts, params, lora) as outputs:
            if self.role == "prefill":
                return await self._prefill_answer(m, request, run, outputs)
            return await (run.stream(request, outputs, include_usage) if stream else run.whole(outputs))

    @contextlib.asynccontextmanager
    async def running(self, m: ServedModel, adapter: ServedAdapter | None, run: CompletionResponse, body: dict,
                      prompts: list, params, engine_args: dict | None = None):
        """Submits one engine request per prompt (ids f"{run.id}-{k}", with `params`: what the engine is asked,
        which a cascade may widen past what the client sees) and yields their merged outputs, (k, output); on the
        way out, however it ends (a client gone, a cancelled handler, an error), aborts what is unfinished (a no-op
        for a finished request) and counts it. engine_args: add_request's other arguments (lora_request,
        prefilled)."""
        if isinstance(run, CompletionResponse):  # (a cascade's scoring pass shows the client nothing)
            run.check_size(prompts)  # before anything is submitted: a 400, no engine work
            if run.chat:  # every chat-built API (Messages too): a grammar starts after the reasoning
                params = m.reasoning_params(params, prompts[0])
        admitted = []
        try:
            streams = []
            for k, prompt in enumerate(prompts):
                try:
                    streams.append(await m.engine.add_request(prompt, params, f"{run.id}-{k}", **(engine_args or {})))
                    admitted.append(f"{run.id}-{k}")
                    if adapter is not None:
                        m.metrics.lora_request(adapter.name)
                except (ValueError, TypeError) as e:  # bad token ids, a request the cache can never hold, ...
                    if params.structured_outputs is not None and str(e).startswith("structured_outputs"):
                        raise grammar_error(body, e) from None  # a grammar that does not compile
                    raise ApiError(400, str(e), getattr(e, "param", None)) from None
                except EngineDeadError as e:
                    raise ApiError(503, str(e)) from None
            async with contextlib.aclosing(merged(streams)) as outputs:
                yield outputs
        finally:
            for request_id in admitted:
                m.engine.abort(request_id)
            if admitted and run.handed_off is None:
                for reason in run.finish:
                    if reason is None:
                        m.metrics.finished("abort")

    async def _prefill_answer(self, m: ServedModel, request, run: CompletionResponse, outputs) -> web.Response:
        """The first token's answer; unless that token ended the request, its pages go to the KV store and the
        answer says where (kv_transfer_params)."""
        body = await run.whole_body(outputs)
        if run.handed_off is not None:
            handed = await asyncio.to_thread(m.engine.handed_off, run.handed_off)  # the pages' copy to the host
            remote = await self.prefill_side.hand_off(handed, request.transport.get_extra_info("sockname")[0])
            body[KV_TRANSFER_FIELD] = remote.to_json()
        return await run.respond(body)


async def serve(server: Server, host: str, port: int, grace_period_s: float = 30.0,
                ready: asyncio.Event | None = None) -> None:
    """Serves until SIGTERM/SIGINT; then stops accepting, gives running requests grace_period_s to finish
    (cancelling the rest aborts them), and shuts the engine down."""
    runner = await run_until_signalled(server.app(), host, port, ", ".join(server.models), ready)
    logger.warning("shutting down: finishing %d running sequences (at most %.0f s)", server.in_flight,
                   grace_period_s)
    server.draining = True
    await drain(runner, lambda: server.in_flight, grace_period_s)
    # What still runs ends now: its streams get an error event and [DONE], its pages go back. Every engine at once.
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(None, engine.shutdown, 30.0) for engine in server.engines()))
    for m in server.models.values():
        m.close()
    await runner.cleanup()
