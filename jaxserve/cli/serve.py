"""`jaxserve serve`: the OpenAI-compatible server over one engine per --model, every flag checked before anything
loads."""
from __future__ import annotations

from jaxserve.cli.processes import lead, load_llm
from jaxserve.engine_config import EngineConfig
from jaxserve.weights.default_model import DEFAULT_MODEL


def cmd_serve(args) -> None:
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server import Server
    from jaxserve.server.lora_modules import LoRAModulePath, check_lora_modules
    from jaxserve.server.served_model import AutoTools
    _check_server_flags(args)
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
    role = _checked_role(args, configs)
    trust = _kv_trust(args, role)
    server_args = dict(api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                       max_request_sequences=args.max_request_sequences, max_logprobs=args.max_logprobs,
                       max_logprob_entries=args.max_logprob_entries, responses_store_size=args.responses_store_size,
                       stream_write_timeout_s=args.stream_write_timeout, header_timeout_s=args.header_timeout,
                       body_timeout_s=args.body_timeout, allow_runtime_lora_updating=runtime_lora,
                       prefill_side=_prefill_side(args, role, trust), kv_trust=trust, cascade=cascade,
                       auto_tools=AutoTools(args.tool_call_parser, args.enable_auto_tool_choice),
                       reasoning_parser=args.reasoning_parser,
                       **({"kv_fetch_timeout_s": args.kv_fetch_timeout} if args.kv_fetch_timeout is not None else {}))

    def run(llms) -> None:
        server = Server({name: AsyncEngine(llm) for name, llm in zip(names, llms)}, **server_args)
        asyncio.run(_serve_with_adapters(server, lora_modules, args))
    if len(configs) == 1:  # may be a multi-process run: the other processes follow process 0's steps
        lead(load_llm(configs[0]), lambda llm: run([llm]), args.shutdown_grace_period)
        return
    # One after another: each engine's default KV budget is its own share (see per_model_from_cli_args), so the
    # second does not need to know what the first holds.
    run([load_llm(c) for c in configs])


def _check_server_flags(args) -> None:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    if args.max_request_sequences is not None and args.max_request_sequences < 1:
        raise ValueError(f"--max-request-sequences must be >= 1, got {args.max_request_sequences}")
    from jaxserve.openai.answer_size import LogprobLimits
    LogprobLimits(args.max_logprobs, args.max_logprob_entries)  # its ValueError names a bad flag
    for flag in ("stream_write_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")


def _checked_role(args, configs) -> str:
    """The server's --role (both, prefill or decode), checked against the models and the KV transfer flags, each
    of which belongs to one role."""
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
    if role != "decode" and args.kv_transfer_peers is not None:
        raise ValueError("--kv-transfer-peers is a decode server's (--role decode)")
    if role == "both" and args.kv_transfer_secret is not None:
        raise ValueError("--kv-transfer-secret is a role server's (--role prefill|decode)")
    return role


def _kv_trust(args, role: str):
    """A role server's KVTrust: the shared secret (--kv-transfer-secret, else JAXSERVE_KV_SECRET), and
    --kv-transfer-peers. None for --role both. Without the secret a role server serves no kv_transfer_params, so none
    of the router's requests: that is an error where other hosts could reach it (surely a missing secret), and
    allowed on loopback only (a test's server, say)."""
    import os

    from jaxserve.openai.kv_transfer_params import SECRET_ENV
    from jaxserve.server.kv_trust import KVTrust
    if role == "both":
        return None
    secret = args.kv_transfer_secret or os.environ.get(SECRET_ENV) or None
    hosts = [args.host] + ([args.kv_transfer_host] if args.kv_transfer_host is not None else [])
    if secret is None and not all(_loopback(h) for h in hosts):
        raise ValueError(f"--role {role} on {', '.join(hosts)} needs --kv-transfer-secret (or {SECRET_ENV}), the "
                         "one `jaxserve router` has: without it a role server serves no kv_transfer_params, so none "
                         "of the router's requests")
    trust = KVTrust.of(secret, args.kv_transfer_peers)
    if secret is None:
        import sys
        print(f"jaxserve: note: --role {role} without --kv-transfer-secret (or {SECRET_ENV}) serves no "
              "kv_transfer_params: it refuses every request, the router's too", file=sys.stderr)
    return trust


def _loopback(host: str) -> bool:
    import ipaddress
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _prefill_side(args, role: str, trust):
    """A prefill server's side of the KV transfer (its port bound now), None for the other roles."""
    if role != "prefill":
        return None
    from jaxserve.server.disaggregated import DEFAULT_MAX_BYTES, PrefillSide
    max_bytes = DEFAULT_MAX_BYTES if args.kv_transfer_max_bytes is None else args.kv_transfer_max_bytes
    return PrefillSide(args.kv_transfer_host or args.host, args.kv_transfer_port, max_bytes=max_bytes, trust=trust)


def _cascade_config(args, names: list[str], adapters: list[str]):
    """--cascade and its flags as a CascadeConfig (None without --cascade), the router file read: every error before
    anything loads."""
    from jaxserve.cascade.policy import CascadeConfig
    from jaxserve.cascade.router_file import CascadeRouter
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
    router = CascadeRouter.load(args.router_file) if args.router_file is not None else None
    return CascadeConfig(tiers, name, args.cascade_policy, router, args.cascade_threshold)


async def _serve_with_adapters(server, lora_modules, args) -> None:
    """Loads --lora-modules into their engines (a bad one ends the run with the loader's message), then serves."""
    from jaxserve.openai.errors import ApiError
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
