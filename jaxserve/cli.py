"""The `jaxserve` command: generate, chat, serve, router, convert."""
from __future__ import annotations

import argparse
import logging
import sys

from jaxserve.engine_config import EngineConfig, add_quantization_cli_args, quantization_from_cli_args
from jaxserve.weights.default_model import DEFAULT_MODEL


def _verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and compilation")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; higher is more random")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this much probability")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min_p x the most likely")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling: same seed and prompt, same text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming tokens as they come",
                         description="Complete one prompt, streaming the text to the terminal.")
    gen.add_argument("--prompt", required=True, help="the text to complete")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineConfig.add_cli_args(gen)
    _verbose_arg(gen)
    _sampling_args(gen, 128)
    chat = sub.add_parser("chat", help="an interactive chat using the model's chat template",
                          description="Interactive chat. Empty line or Ctrl-D quits.")
    chat.add_argument("--system", default=None, help="a system prompt (default: the template's own, if any)")
    EngineConfig.add_cli_args(chat)
    _verbose_arg(chat)
    _sampling_args(chat, 512)
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                         description="Serve the model over HTTP with the OpenAI API (/v1/completions, "
                                     "/v1/chat/completions, /v1/models), /health and /metrics (Prometheus). Several "
                                     "--model serve several models at once, an engine each, picked by the request's "
                                     "'model' (none: the first); every other flag applies to each.")
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
                     help="--role prefill: the most bytes of KV pages held waiting to be fetched (default: no bound); "
                          "when full, the server answers 503 and the router tries another prefill server")
    srv.add_argument("--kv-transfer-host", default=None,
                     help="--role prefill: the address to bind that port on and the one decode servers are told "
                          "(default: --host; bound to a wildcard such as 0.0.0.0, decode servers are told the address "
                          "each request came in on)")
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
    EngineConfig.add_cli_args(srv, serving=True)
    _verbose_arg(srv)
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
    _verbose_arg(rt)
    conv = sub.add_parser("convert", help="write a model as a jaxserve (orbax) checkpoint that loads faster",
                          description="Load SRC (a .gguf, a HF directory, or the default model name) and write a "
                                      "jaxserve checkpoint to DST: params (orbax), config and tokenizer.")
    conv.add_argument("src", help=f"the model to convert ({DEFAULT_MODEL} for the default model)")
    conv.add_argument("dst", help="a new directory to write")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the saved params")
    add_quantization_cli_args(conv)
    conv.add_argument("-v", "--verbose", action="store_true", help="log loading")
    return parser


def _sampling_params(args):
    from jaxserve import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed)


def _llm(args):
    return _load(EngineConfig.from_cli_args(args))


def _lead(llm, command, grace_s: float = 30.0) -> None:
    """command(llm) on process 0; the other processes of a multi-process run follow its steps until it is done.

    SIGTERM (JAX's preemption notifier would swallow it) ends the run wherever it lands: on process 0 as a stop
    (serve drains for its grace period), on another process as a request to process 0 to stop the same way; that
    process ends on its own if the run has not ended when process 0's drain (grace_s) and shutdown should be over."""
    import signal

    from jaxserve.multihost import HEARTBEAT_TIMEOUT_S, exit_now, take_held_sigterm
    processes = llm.processes
    if processes.is_follower:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches every process: process 0 decides

        def stop(*_):
            import threading
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # asked once
            processes.request_stop()
            # Process 0's drain: the grace period, then its engines' shutdown (30 s at most) and the server's
            # cleanup (5 s), and the heartbeat that tells this process it is gone.
            limit = grace_s + 30 + 5 + 2 * HEARTBEAT_TIMEOUT_S
            timer = threading.Timer(limit, exit_now, (1, f"jaxserve: error: process 0 did not end the run within "
                                                         f"{limit:.0f} s of this process's SIGTERM"))
            timer.daemon = True
            timer.start()
        signal.signal(signal.SIGTERM, stop)
        if take_held_sigterm():  # it came while the model loaded
            stop()
        try:
            llm.follow()
        except BaseException as e:  # noqa: BLE001 - whatever it is, the leader must not wait for this process
            # Not through JAX's shutdown barrier, which would hold this process while the leader waits on it in a
            # step: gone, it is noticed by the coordination service, which ends the others.
            exit_now(1, f"jaxserve: error: {type(e).__name__}: {e}")
        return
    if processes.multi_process:
        import os
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # generate / chat: as Ctrl-C; serve sets its own
        processes.watch_stop_requests(lambda: os.kill(os.getpid(), signal.SIGTERM))
    try:
        if not take_held_sigterm():  # one that came while the model loaded ends the run before it starts
            command(llm)
    finally:
        llm.shutdown()


def cmd_generate(args) -> None:
    params = _sampling_params(args)  # invalid values fail before the model loads
    _lead(_llm(args), lambda llm: _generate(llm, args, params))


def _generate(llm, args, params) -> None:
    prompt = args.prompt
    if args.chat:
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                   add_special_tokens=False)
        prompt = {"prompt_token_ids": ids}
    for piece in llm.stream(prompt, params):
        print(piece, end="", flush=True)
    print()


def cmd_chat(args) -> None:
    params = _sampling_params(args)
    _lead(_llm(args), lambda llm: _chat(llm, args, params))


def _chat(llm, args, params) -> None:
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        text = llm.tokenizer.apply_chat_template(messages)
        reply = ""
        for piece in llm.stream({"prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False)}, params):
            print(piece, end="", flush=True)
            reply += piece
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> None:
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server import Server
    from jaxserve.server.lora_modules import LoRAModulePath, check_lora_modules
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.max_request_sequences is not None and args.max_request_sequences < 1:
        raise ValueError(f"--max-request-sequences must be >= 1, got {args.max_request_sequences}")
    for flag in ("stream_write_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    # Names and configs are checked before anything loads.
    names = _served_model_names(args.served_model_name, args.model or [None])
    configs = EngineConfig.per_model_from_cli_args(args)
    lora_modules = [LoRAModulePath.parse(spec) for spec in args.lora_modules or []]
    check_lora_modules(lora_modules, names)
    cascade = _cascade_config(args, names, [m.name for m in lora_modules])
    runtime_lora = args.allow_runtime_lora_updating or _env_flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    if (lora_modules or args.allow_runtime_lora_updating) and not configs[0].enable_lora:
        flag = "--lora-modules" if lora_modules else "--allow-runtime-lora-updating"
        raise ValueError(f"{flag} serves LoRA adapters: it needs --enable-lora")
    role = configs[0].role
    if role != "both" and len(configs) > 1:
        raise ValueError(f"--role {role} serves one model")
    if not 0 <= args.kv_transfer_port < 65536:
        raise ValueError(f"--kv-transfer-port must be in 0-65535, got {args.kv_transfer_port}")
    if args.kv_fetch_timeout is not None and (role != "decode" or not args.kv_fetch_timeout > 0):
        raise ValueError(f"--kv-fetch-timeout is a decode server's (--role decode), > 0 seconds; got "
                         f"{args.kv_fetch_timeout} with --role {role}")
    if args.kv_transfer_max_bytes is not None and args.kv_transfer_max_bytes < 1:
        raise ValueError(f"--kv-transfer-max-bytes must be >= 1, got {args.kv_transfer_max_bytes}")
    if role != "prefill" and (args.kv_transfer_port or args.kv_transfer_host is not None
                              or args.kv_transfer_max_bytes is not None):
        raise ValueError("--kv-transfer-port, --kv-transfer-host and --kv-transfer-max-bytes are a prefill server's "
                         "(--role prefill)")
    prefill_side = None
    if role == "prefill":
        from jaxserve.server.disaggregated import PrefillSide
        prefill_side = PrefillSide(args.kv_transfer_host or args.host, args.kv_transfer_port,
                                   max_bytes=args.kv_transfer_max_bytes)
    server_args = dict(api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                       max_request_sequences=args.max_request_sequences,
                       stream_write_timeout_s=args.stream_write_timeout, header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout, allow_runtime_lora_updating=runtime_lora,
                       prefill_side=prefill_side, cascade=cascade,
                       **({"kv_fetch_timeout_s": args.kv_fetch_timeout} if args.kv_fetch_timeout is not None else {}))

    def run(llms) -> None:
        server = Server({name: AsyncEngine(llm) for name, llm in zip(names, llms)}, **server_args)
        asyncio.run(_serve_with_adapters(server, lora_modules, args))
    if len(configs) == 1:  # may be a multi-process run: the other processes follow process 0's steps
        _lead(_load(configs[0]), lambda llm: run([llm]), args.shutdown_grace_period)
        return
    # One after another: each engine's default KV budget is its own share (see per_model_from_cli_args), so the
    # second does not need to know what the first holds.
    run([_load(c) for c in configs])


def _cascade_config(args, names: list[str], adapters: list[str]):
    """--cascade and its flags as a CascadeConfig (None without --cascade), the router file read: every error before
    anything loads."""
    from jaxserve.cascade.policy import CascadeConfig
    from jaxserve.cascade.router_file import Router
    if args.cascade is None:
        given = [flag for flag, value in (("--cascade-name", args.cascade_name), ("--cascade-policy",
                 args.cascade_policy), ("--router-file", args.router_file), ("--cascade-threshold",
                 args.cascade_threshold)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} configure a cascade: give --cascade TIER,TIER too")
        return None
    tiers = tuple(t.strip() for t in args.cascade.split(","))
    unknown = [t for t in tiers if t and t not in names]
    if unknown:
        raise ValueError(f"--cascade {args.cascade}: {', '.join(map(repr, unknown))} is not a served model (served: "
                         f"{', '.join(names)}; a tier is a --served-model-name, or a --model when none is given)")
    name = "auto" if args.cascade_name is None else args.cascade_name
    if name in names or name in adapters:
        raise ValueError(f"--cascade-name {name!r} is already a served model's or adapter's name: give the cascade "
                         "its own (--cascade-name)")
    router = Router.load(args.router_file) if args.router_file is not None else None
    return CascadeConfig(tiers, name, args.cascade_policy, router, args.cascade_threshold)


def cmd_router(args) -> None:
    import asyncio

    from jaxserve.router import Router, serve_router
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    for flag in ("prefill_timeout", "decode_timeout", "connect_timeout", "health_interval"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    router = Router(args.prefill, args.decode, prefill_timeout_s=args.prefill_timeout,
                    decode_timeout_s=args.decode_timeout, connect_timeout_s=args.connect_timeout,
                    health_interval_s=args.health_interval)
    asyncio.run(serve_router(router, args.host, args.port, args.shutdown_grace_period))


async def _serve_with_adapters(server, lora_modules, args) -> None:
    """Loads --lora-modules into their engines (a bad one ends the run with the loader's message), then serves."""
    from jaxserve.openai.api import ApiError
    from jaxserve.server import serve
    for module in lora_modules:
        try:
            await server.lora.load(module.name, module.path, module.base_model_name)
        except ApiError as e:
            for engine in server.engines():
                engine.shutdown(30.0)
            raise ValueError(f"--lora-modules {module.name}: {e.message}") from None
    await serve(server, args.host, args.port, args.shutdown_grace_period)


def _env_flag(name: str) -> bool:
    """An environment switch as vLLM reads its own: "1" or "true" (any case) is on."""
    import os
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


def _load(config):
    from jaxserve import LLM
    return LLM.from_config(config)


def _served_model_names(given: list[str] | None, models: list[str | None]) -> list[str]:
    """--served-model-name once per --model, or never (then each model's --model value, or the default model's)."""
    names = given or [model or DEFAULT_MODEL for model in models]
    if len(names) != len(models):
        raise ValueError(f"--served-model-name was given {len(names)} times for {len(models)} model(s): give it once "
                         "per --model, in the same order, or not at all")
    if any(not name for name in names):
        raise ValueError("--served-model-name must not be empty")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"each served model needs its own name, but {', '.join(map(repr, repeated))} names several "
                         "(give --served-model-name once per --model)")
    return names


def cmd_convert(args) -> None:
    from pathlib import Path

    from jaxserve.quantize.apply import quantize_model
    from jaxserve.weights import load_model, resolve_dtype
    from jaxserve.weights.orbax_ckpt import save_checkpoint
    q = quantization_from_cli_args(args)
    loaded = quantize_model(load_model(args.src, resolve_dtype(args.dtype)), q["quantization"],
                            group_size=q["quantization_group_size"], quantize_embeddings=q["quantize_embeddings"],
                            calibration_text=q["calibration_text"])
    save_checkpoint(Path(args.dst), loaded.config, loaded.params, loaded.tokenizer, loaded.quantization)
    print(f"wrote {args.dst}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    handler = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "router": cmd_router,
               "convert": cmd_convert}[args.command]
    if getattr(args, "coordinator_address", None) is not None:
        _answers_only_on_stdout()
    try:
        handler(args)
    except (ValueError, RuntimeError, OSError) as e:
        # User errors (bad model path, bad parameter, prompt too long) get one line, not a traceback.
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _answers_only_on_stdout() -> None:
    """stdout carries the answer only. Libraries of a multi-process run write to file descriptor 1 from C++ (gloo:
    "[Gloo] Rank 0 is connected to ..."), so fd 1 becomes stderr and Python's stdout keeps the original."""
    import os
    sys.stdout.flush()
    answers = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(answers, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)


if __name__ == "__main__":
    sys.exit(main())
