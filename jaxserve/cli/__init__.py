"""The `jaxserve` command: generate, chat, serve, router, convert, build-kernels. `build_parser` declares the
command line (parser.py), `main` runs one command: generate.py (generate, chat), serve.py, commands.py (router,
convert, build-kernels); the engine, the server and the router are imported by the command that runs them."""
from __future__ import annotations

import functools
import logging
import os
import sys

from jaxserve.cli import commands, generate, serve
from jaxserve.cli.parser import build_parser

__all__ = ["build_parser", "main"]

HANDLERS = {"generate": generate.cmd_generate, "chat": generate.cmd_chat, "serve": serve.cmd_serve,
            "router": commands.cmd_router, "convert": commands.cmd_convert,
            "build-kernels": commands.cmd_build_kernels}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    handler = HANDLERS[args.command]
    if getattr(args, "distributed_executor_backend", None) == "ray":  # the command placed on Ray nodes (docs/ray.md)
        from jaxserve.scaleout.launch import serve_on_ray
        handler = functools.partial(serve_on_ray, argv=argv)
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
    sys.stdout.flush()
    answers = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(answers, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors)
