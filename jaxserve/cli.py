"""The `jaxserve` command: generate, chat, serve, convert."""
from __future__ import annotations

import argparse
import logging
import sys

from jaxserve.weights.default_model import DEFAULT_MODEL


def _engine_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    p.add_argument("--model", default=None,
                   help=f"a .gguf file, a HF model directory, or a jaxserve checkpoint (default: {DEFAULT_MODEL}, "
                        "fetched once into ~/.cache/jaxserve or $JAXSERVE_CACHE)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="parameter and activation dtype (auto: float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache page")
    _quantization_args(p)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV-cache pages: auto (the model's dtype) or int8 (about twice the sequences per byte)")
    _speculative_args(p)
    if serving:
        p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences decoding together")
        p.add_argument("--max-num-batched-tokens", type=int, default=512,
                       help="tokens per step: one per decoding sequence, the rest prompt chunks")
        p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="do not reuse the KV pages of prompt prefixes seen before")
        p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
        p.add_argument("--ttft-slo", type=float, default=None, help="time-to-first-token target, seconds")
        p.add_argument("--tpot-slo", type=float, default=None, help="time-per-output-token target, seconds")
        p.add_argument("--attention-backend", default="auto",
                       choices=["auto", "reference", "pallas", "pallas-gpu", "pallas-tpu"])
        p.add_argument("--no-warmup", dest="warmup", action="store_false",
                       help="compile shapes on first use instead of before serving")
    else:
        p.add_argument("--warmup", action="store_true", help="compile every shape bucket before generating")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and compilation")


def _quantization_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "awq"],
                   help="weight-only quantization of the linear layers: int8 (a scale per output channel), int4 "
                        "(groups of input rows, two values a byte), awq (int4 with calibrated input scales)")
    p.add_argument("--quantization-group-size", type=int, default=None,
                   help="input rows per int4 group (default: 32 for int4, as llama.cpp's Q4_1; 128 for awq)")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="also quantize the LM head and the embedding table")
    p.add_argument("--calibration-file", default=None,
                   help="text to calibrate awq on (default: a public-domain text the package ships)")


def _speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft_model"],
                   help="speculative decoding: ngram (prompt lookup, no model) or draft_model (--draft-model)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="tokens proposed per verification (default 4 with a speculative method)")
    p.add_argument("--draft-model", default=None,
                   help="the draft for draft_model: a model sharing the target's tokenizer (.gguf, HF dir, checkpoint; "
                        "scripts/train_draft.py distills one for the default model)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: the longest suffix looked up")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: the shortest suffix looked up")
    p.add_argument("--no-adaptive-speculation", dest="adaptive_speculation", action="store_false",
                   help="speculate for every sequence every step, not only where measured acceptance and step "
                        "costs say it pays")


def _speculative_config(args) -> dict | None:
    method = args.speculative_method or ("draft_model" if args.draft_model else None)
    if method is None:
        if args.num_speculative_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative-method (or --draft-model)")
        return None
    config = dict(method=method, num_speculative_tokens=4 if args.num_speculative_tokens is None
                  else args.num_speculative_tokens, adaptive=args.adaptive_speculation)
    if method == "ngram":
        config.update(prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
    elif args.draft_model:
        config["model"] = args.draft_model
    return config


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
    _engine_args(gen)
    _sampling_args(gen, 128)
    chat = sub.add_parser("chat", help="an interactive chat using the model's chat template",
                          description="Interactive chat. Empty line or Ctrl-D quits.")
    chat.add_argument("--system", default=None, help="a system prompt (default: the template's own, if any)")
    _engine_args(chat)
    _sampling_args(chat, 512)
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                         description="Serve the model over HTTP with the OpenAI API (/v1/completions, "
                                     "/v1/chat/completions, /v1/models), /health and /metrics (Prometheus).")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 requests")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
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
    _engine_args(srv, serving=True)
    conv = sub.add_parser("convert", help="write a model as a jaxserve (orbax) checkpoint that loads faster",
                          description="Load SRC (a .gguf, a HF directory, or the default model name) and write a "
                                      "jaxserve checkpoint to DST: params (orbax), config and tokenizer.")
    conv.add_argument("src", help=f"the model to convert ({DEFAULT_MODEL} for the default model)")
    conv.add_argument("dst", help="a new directory to write")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the saved params")
    _quantization_args(conv)
    conv.add_argument("-v", "--verbose", action="store_true", help="log loading")
    return parser


def _sampling_params(args):
    from jaxserve import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed)


def _llm(args):
    from jaxserve import LLM
    # One prompt at a time: a single decode row keeps the set of compiled programs (and start-up) small.
    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
               max_num_seqs=1, kv_cache_dtype=args.kv_cache_dtype, speculative_config=_speculative_config(args),
               warmup=args.warmup, **_quantization(args))


def _quantization(args) -> dict:
    from pathlib import Path
    text = Path(args.calibration_file).read_text() if args.calibration_file else None
    return dict(quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                quantize_embeddings=args.quantize_embeddings, calibration_text=text)


def cmd_generate(args) -> None:
    params = _sampling_params(args)  # invalid values fail before the model loads
    llm = _llm(args)
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
    llm = _llm(args)
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

    from jaxserve import LLM
    from jaxserve.async_engine import AsyncEngine
    from jaxserve.server import Server, serve
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1-65535, got {args.port}")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.max_request_sequences is not None and args.max_request_sequences < 1:
        raise ValueError(f"--max-request-sequences must be >= 1, got {args.max_request_sequences}")
    for flag in ("stream_write_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0 seconds, got {getattr(args, flag)}")
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=args.enable_prefix_caching, scheduling_policy=args.scheduling_policy,
              ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype, speculative_config=_speculative_config(args), warmup=args.warmup,
              **_quantization(args))
    name = args.served_model_name or args.model or DEFAULT_MODEL
    server = Server(AsyncEngine(llm), name, api_key=args.api_key, max_queued_requests=args.max_queued_requests,
                    max_request_sequences=args.max_request_sequences, stream_write_timeout_s=args.stream_write_timeout,
                    header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
    asyncio.run(serve(server, args.host, args.port, args.shutdown_grace_period))


def cmd_convert(args) -> None:
    from pathlib import Path

    from jaxserve.quantize import quantize_model
    from jaxserve.weights import load_model, resolve_dtype
    from jaxserve.weights.orbax_ckpt import save_checkpoint
    q = _quantization(args)
    loaded = quantize_model(load_model(args.src, resolve_dtype(args.dtype)), q["quantization"],
                            group_size=q["quantization_group_size"], quantize_embeddings=q["quantize_embeddings"],
                            calibration_text=q["calibration_text"])
    save_checkpoint(Path(args.dst), loaded.config, loaded.params, loaded.tokenizer, loaded.quantization)
    print(f"wrote {args.dst}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    handler = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "convert": cmd_convert}[args.command]
    try:
        handler(args)
    except (ValueError, RuntimeError, OSError) as e:
        # User errors (bad model path, bad parameter, prompt too long) get one line, not a traceback.
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
