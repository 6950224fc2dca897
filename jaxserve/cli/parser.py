"""The `jaxserve` command line: one function per sub-command declares its flags (the engine's own come from
EngineConfig's fields, jaxserve.cli_flags)."""
from __future__ import annotations

import argparse

from jaxserve.engine_config import EngineConfig, add_quantization_cli_args
from jaxserve.openai.reasoning import REASONING_PARSERS
from jaxserve.openai.responses_store import DEFAULT_STORE_SIZE
from jaxserve.openai.tool_call_parsers import TOOL_PARSERS
from jaxserve.weights.default_model import DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_chat, _add_serve, _add_router, _add_convert, _add_build_kernels):
        add(sub)
    return parser


def _verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and compilation")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; higher is more random")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this much probability")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min_p x the most likely")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling: same seed and prompt, same text")


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="complete one prompt, streaming tokens as they come",
                         description="Complete one prompt, streaming the text to the terminal.")
    gen.add_argument("--prompt", required=True, help="the text to complete")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineConfig.add_cli_args(gen)
    _verbose_arg(gen)
    _sampling_args(gen, 128)


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="an interactive chat using the model's chat template",
                          description="Interactive chat. Empty line or Ctrl-D quits.")
    chat.add_argument("--system", default=None, help="a system prompt (default: the template's own, if any)")
    EngineConfig.add_cli_args(chat)
    _verbose_arg(chat)
    _sampling_args(chat, 512)


def _add_serve(sub) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                         description="Serve the model over HTTP with the OpenAI API (/v1/completions, "
                                     "/v1/chat/completions, /v1/models), /health and /metrics (Prometheus). Several "
                                     "--model serve several models at once, an engine each, picked by the request's "
                                     "'model' (none: the first); every other flag applies to each.")
    _server_flags(srv)
    _tool_flags(srv)
    _lora_and_kv_transfer_flags(srv)
    _cascade_flags(srv)
    _ray_flags(srv)
    EngineConfig.add_cli_args(srv, serving=True)
    _verbose_arg(srv)


def _server_flags(srv: argparse.ArgumentParser) -> None:
    """How the HTTP server listens, admits and times out."""
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 requests")
    srv.add_argument("--served-model-name", default=None, action="append",
                     help="the model name clients send (default: --model); with several --model, once for each, in "
                          "the same order")
    srv.add_argument("--max-queued-requests", type=int, default=256,
                     help="sequences waiting beyond the running batch before new requests get 429")
    srv.add_argument("--max-request-sequences", type=int, default=None,
                     help="most sequences (n x prompts) one request may ask for; more is a 400 (default: "
                          "--max-num-seqs)")
    srv.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE,
                     help="most responses kept in memory for /v1/responses' previous_response_id and GET (the least "
                          "recently used go first; 0: none stored)")
    srv.add_argument("--max-logprobs", type=int, default=20,
                     help="most top logprobs one position may show (logprobs, top_logprobs, prompt_logprobs; "
                          "vLLM's flag; at most 20); more is a 400")
    srv.add_argument("--max-logprob-entries", type=int, default=500_000,
                     help="most logprob entries one answer may hold (positions x (top logprobs + 1), per choice; "
                          "~70 bytes each); a request whose answer could hold more is a 400 before any work")
    srv.add_argument("--stream-write-timeout", type=float, default=30.0,
                     help="seconds one write of a stream may wait for a client that does not read before the "
                          "connection is dropped and the request aborted")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection gets to send a whole request head (from its opening or the previous "
                          "response, so idle keep-alive connections too) before it is closed")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request gets to send its whole body before a 408")
    srv.add_argument("--shutdown-grace-period", type=float, default=30.0,
                     help="seconds running requests get to finish after SIGTERM")
    srv.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                     help="split the model's <think>...</think> from its chat answers into reasoning_content "
                          "(vLLM's flag and names; structured output then applies to the answer after it)")


def _tool_flags(srv: argparse.ArgumentParser) -> None:
    """tool_choice auto, as vLLM's flags (docs/structured-output-and-tools.md)."""
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="serve tool_choice auto (the default with tools): the model's own tool calls parsed from its "
                          "output; without it auto is a 400, as vLLM's")
    srv.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                     help="the format of the model's tool calls (default: the one its chat template writes, where "
                          "recognised)")


def _lora_and_kv_transfer_flags(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT directories) to serve, each under its name (a request's 'model'), on "
                          "the first model; or JSON '{\"name\": .., \"path\": .., \"base_model_name\": ..}' for "
                          "another base. Needs --enable-lora")
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; also on with "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1). Needs --enable-lora")
    srv.add_argument("--kv-transfer-port", type=int, default=0,
                     help="--role prefill: the port its KV pages are fetched from by decode servers (default: a "
                          "free one, told to the router with each request)")
    srv.add_argument("--kv-fetch-timeout", type=float, default=None,
                     help="--role decode: seconds a KV pages fetch from a prefill server may take (default: 30)")
    srv.add_argument("--kv-transfer-max-bytes", type=int, default=None,
                     help="--role prefill: the most bytes of KV pages held waiting to be fetched (default: 4 GiB); "
                          "when full, the server answers 503 and the router tries another prefill server")
    _kv_secret_arg(srv, "--role prefill|decode")
    srv.add_argument("--kv-transfer-peers", default=None, metavar="HOST[:PORT],...",
                     help="--role decode: the only prefill KV ports it fetches from (default: any whose address "
                          "comes MACed by a prefill server)")
    srv.add_argument("--kv-transfer-host", default=None,
                     help="--role prefill: the address to bind that port on and the one decode servers are told "
                          "(default: --host; bound to a wildcard such as 0.0.0.0, decode servers are told the address "
                          "each request came in on)")


def _ray_flags(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--distributed-executor-backend", default=None, choices=["ray", "external_launcher"],
                     help="ray: run on the Ray head to place --num-processes processes of this command, one per Ray "
                          "node (a placement group, STRICT_SPREAD; docs/ray.md), and print process 0's URL; "
                          "external_launcher (the default): this process is one of a group another launcher started "
                          "(--coordinator-address ...)")
    srv.add_argument("--ray-bundle", default=None, metavar="JSON",
                     help="with --distributed-executor-backend ray: the resources each process holds on its node, "
                          "e.g. '{\"TPU\": 4}' (a TPU host's chips) or '{\"GPU\": 8}' (default: '{\"CPU\": 1}')")


def _cascade_flags(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--cascade", default=None, metavar="TIER,TIER[,...]",
                     help="serve a cascade over these served models (their --served-model-name, cheapest first): a "
                          "request whose 'model' is --cascade-name is answered by the cheapest tier the router lets "
                          "keep it, and its answer names that tier")
    srv.add_argument("--cascade-name", default=None,
                     help="the model name that requests give to be routed by the cascade (default: auto)")
    srv.add_argument("--cascade-policy", default=None, choices=["before", "after"],
                     help="before: each tier scores the prompt (its prefill) and a classifier picks the tier; after: "
                          "the cheapest tier answers and the answer is judged, escalating if below the threshold "
                          "(streams are routed before generating). Default: before if the router file has before "
                          "classifiers, else after")
    srv.add_argument("--router-file", default=None,
                     help="the trained router (JSON, scripts/train_router.py) whose tiers are --cascade's; without "
                          "it the after policy keeps an answer whose per-token probability is at least "
                          "--cascade-threshold")
    srv.add_argument("--cascade-threshold", type=float, default=None,
                     help="a probability in [0, 1] every tier's classifier must reach to keep a request, instead of "
                          "the router file's (higher: more requests go to the larger tiers)")


def _add_router(sub) -> None:
    rt = sub.add_parser("router", help="the OpenAI API over separate prefill and decode servers",
                        description="Proxy the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) over "
                                    "prefill servers and decode servers (`jaxserve serve --role prefill|decode`): "
                                    "each request is prefilled on one, its KV pages moved, and decoded on the other. "
                                    "/health is 200 while each pool has a healthy server; /metrics is the router's.")
    rt.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                    help="the prefill servers (http://host:port)")
    rt.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                    help="the decode servers (http://host:port)")
    rt.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    rt.add_argument("--port", type=int, default=8000)
    rt.add_argument("--prefill-timeout", type=float, default=300.0,
                    help="seconds a prefill server may take to answer before the request is retried on another")
    rt.add_argument("--decode-timeout", type=float, default=120.0,
                    help="seconds a decode server's stream may stay silent before the request fails")
    rt.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to open a connection to a server")
    rt.add_argument("--health-interval", type=float, default=2.0,
                    help="seconds between two asks of every server's /health")
    rt.add_argument("--shutdown-grace-period", type=float, default=30.0,
                    help="seconds running requests get to finish after SIGTERM")
    _kv_secret_arg(rt, "required")
    _verbose_arg(rt)


def _kv_secret_arg(parser: argparse.ArgumentParser, who: str) -> None:
    parser.add_argument("--kv-transfer-secret", default=None,
                        help=f"{who}: the secret the router and the prefill and decode servers share (at least 16 "
                             "characters); role servers serve only requests the router MACed with it, and their KV "
                             "ports only its holders. Better given as JAXSERVE_KV_SECRET (not seen in ps). Required "
                             "for role servers not bound to loopback")


def _add_convert(sub) -> None:
    conv = sub.add_parser("convert", help="write a model as a jaxserve (orbax) checkpoint that loads faster",
                          description="Load SRC (a .gguf, a HF directory, or the default model name) and write a "
                                      "jaxserve checkpoint to DST: params (orbax), config and tokenizer.")
    conv.add_argument("src", help=f"the model to convert ({DEFAULT_MODEL} for the default model)")
    conv.add_argument("dst", help="a new directory to write")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the saved params")
    add_quantization_cli_args(conv)
    conv.add_argument("-v", "--verbose", action="store_true", help="log loading")


def _add_build_kernels(sub) -> None:
    kb = sub.add_parser("build-kernels", help="compile the C++ CPU kernels ahead of time, for every CPU variant",
                        description="Compile the C++ CPU kernels for each instruction-set variant of this "
                                    "architecture (x86-64-v4-bf16, x86-64-v4, x86-64-v3 and a baseline; armv8.2-a "
                                    "and armv8-a), so a machine without a C++ compiler runs them: the best variant "
                                    "its CPU has is picked at run time. Build it into an image or a wheel before the "
                                    "compiler is removed.")
    kb.add_argument("--output", default=None, metavar="DIR",
                    help="where to write the libraries (default: the package's cpu_kernels/prebuilt directory; "
                         "jaxserve also looks in $JAXSERVE_CACHE/cpu_kernels)")
    _verbose_arg(kb)
