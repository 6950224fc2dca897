"""`jaxserve serve`: an OpenAI-compatible HTTP server (aiohttp) over an AsyncEngine, which it knows only through the
`jaxserve.engine.client.EngineClient` protocol (nothing of the scheduler, the KV cache or the runner below it).

/v1/completions and /v1/chat/completions (streamed as server-sent events or whole), OpenAI's Responses API
(/v1/responses, over the chat path: `responses_api`), Anthropic's Messages API (/v1/messages, over the chat path:
`messages`), /v1/models, /health and /metrics (Prometheus). Every error is an OpenAI-style body (Anthropic's on its
routes) with a 4xx/5xx status; a bad request never reaches the engine. A client that goes away aborts its request
(its pages are freed before the next step). When more sequences are admitted than the engine runs plus
`max_queued_requests`, the answer is 429 with Retry-After. On SIGTERM the server stops accepting, lets running
requests finish for a grace period, aborts the rest, exits 0.

One client must not hurt another: a request asks for at most `max_request_sequences` (n x prompts); admission is
decided before any costly work, a prompt certainly too long for the context (by its length in characters, see
Tokenizer.max_chars_per_token) is refused before it is tokenized, and tokenizing runs off the event loop on each
model's own `tokenizer_threads` (requests past them wait for that model's threads only, as many as it admits); a
request head, a body, and each write of a stream have a time limit, past which the connection is closed (408 for a
body).

Several models: `Server({name: engine, ...})` serves each engine under its name; a request's `model` field picks
the engine (none: the first), an unknown one is a 404 (code model_not_found, as OpenAI's). Each engine has its own
admission capacity and metrics series (label model_name); /v1/models lists them all; /health is 200 only while every
engine is alive.

LoRA adapters (engines with enable_lora): each served under its own name on one model's engine (`lora_modules`); a
request whose `model` names an adapter runs on its base with it, and its answer names the adapter. /v1/models lists
them (parent: the base model, root: the adapter's path); vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
change them at run time where allowed; /metrics counts each adapter's requests.

A cascade (`--cascade A,B`, `cascade`): a request naming the cascade is answered by the cheapest tier its router
lets keep it (`jaxserve.cascade`: the features, the router file, the policy), and the answer names that tier.

Disaggregated prefill across servers (`--role prefill|decode`, behind `jaxserve router`): a prefill server answers
a request with its first token and holds its KV pages for a decode server to fetch; a decode server fetches them and
streams what follows (see `disaggregated`).

`app` is the HTTP side (routes, middleware, endpoints, `serve`), `served_model` a model's own state (admission
capacity, tokenizing threads, metrics) and checks, `lora_modules` the adapters by name, `disaggregated` the role
servers' side of the KV transfer, `cascade` a cascade's routing over the served models, `responses` a request's
outputs as a JSON body or an SSE stream; `jaxserve.openai.requests` and `jaxserve.openai.responses` the wire format
(its structured-output fields in `jaxserve.openai.structured`, tool calls in `jaxserve.openai.tool_calls`),
`jaxserve.openai.metrics` the Prometheus metrics.
"""
from jaxserve.server.app import Server, serve

__all__ = ["Server", "serve"]
