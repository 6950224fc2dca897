"""`jaxserve generate` (one prompt, streamed) and `jaxserve chat` (a conversation at the terminal)."""
from __future__ import annotations

from jaxserve.cli.processes import lead, load_llm
from jaxserve.engine_config import EngineConfig


def _sampling_params(args):
    from jaxserve import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed)


def _llm(args):
    return load_llm(EngineConfig.from_cli_args(args))


def cmd_generate(args) -> None:
    params = _sampling_params(args)  # invalid values fail before the model loads
    lead(_llm(args), lambda llm: _generate(llm, args, params))


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
    lead(_llm(args), lambda llm: _chat(llm, args, params))


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
