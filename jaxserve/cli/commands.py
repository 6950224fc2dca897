"""The commands that run no engine of their own: `jaxserve router` (the OpenAI API over prefill and decode servers),
`convert` (a model to a jaxserve checkpoint) and `build-kernels` (the C++ CPU kernels, ahead of time)."""
from __future__ import annotations

from jaxserve.engine_config import quantization_from_cli_args


def cmd_router(args) -> None:
    import asyncio

    from jaxserve.router import PDRouter, serve_router
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    for flag in ("prefill_timeout", "decode_timeout", "connect_timeout", "health_interval"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    import os

    from jaxserve.openai.kv_transfer_params import SECRET_ENV
    secret = args.kv_transfer_secret or os.environ.get(SECRET_ENV) or None
    router = PDRouter(args.prefill, args.decode, prefill_timeout_s=args.prefill_timeout,
                      decode_timeout_s=args.decode_timeout, connect_timeout_s=args.connect_timeout,
                      health_interval_s=args.health_interval, kv_secret=secret)
    if secret is None:
        raise ValueError(f"the router needs --kv-transfer-secret (or {SECRET_ENV}): the secret its prefill and decode "
                         "servers were started with")
    asyncio.run(serve_router(router, args.host, args.port, args.shutdown_grace_period))


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


def cmd_build_kernels(args) -> None:
    import sys
    from pathlib import Path

    from jaxserve.cpu_kernels import build
    built = build.build_all(Path(args.output) if args.output is not None else build.PREBUILT_DIR)
    for refused in built.refused:  # a compiler too old for a variant: the CPUs that have it run the next one down
        print(f"jaxserve: skipped {refused}", file=sys.stderr)
    for path in built.written:
        print(f"wrote {path}")
