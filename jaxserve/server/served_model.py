"""One served model: its engine, its admission capacity, its tokenizing threads and its metrics, and the per-model
half of handling a request (admission, tokenizing off the event loop, the context-length checks)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses

from jaxserve.engine.client import EngineClient
from jaxserve.openai.answer_size import LogprobLimits
from jaxserve.openai.errors import ApiError, context_length_error
from jaxserve.openai.metrics import ModelMetrics
from jaxserve.openai.reasoning import REASONING_PARSERS, ThinkParser
from jaxserve.openai.structured import FieldError
from jaxserve.openai.tool_call_parsers import tool_parser_class
from jaxserve.openai.tool_parsers import tags_are_special


@dataclasses.dataclass(frozen=True)
class AutoTools:
    """tool_choice auto, as vLLM serves it: only with --enable-auto-tool-choice (`enabled`); the calls read by the
    parser named by --tool-call-parser (`parser`), or where none is named, by the one the model's chat template's
    format implies (jaxserve.openai.tool_call_parsers)."""
    parser: str | None = None
    enabled: bool = False

    def __post_init__(self):
        tool_parser_class(self.parser, None)  # a name that is none of the parsers' fails here, before serving


class ServedModel:
    """One served engine and what the server keeps for it: its name, capacity, admitted sequences and metrics."""

    def __init__(self, name: str, engine: EngineClient, metrics: ModelMetrics, max_queued_requests: int,
                 max_request_sequences: int | None, tokenizer_threads: int,
                 logprob_limits: LogprobLimits | None = None, auto_tools: AutoTools | None = None,
                 reasoning_parser: str | None = None):
        """reasoning_parser: vLLM's --reasoning-parser name (jaxserve.openai.reasoning), or None: no reasoning
        split from chat answers."""
        self.name, self.engine, self.metrics = name, engine, metrics
        self.auto_tools = auto_tools or AutoTools()
        self.logprob_limits = logprob_limits or LogprobLimits()
        self.tokenizer = engine.tokenizer
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}: one of {', '.join(REASONING_PARSERS)}")
        if reasoning_parser is not None and engine.role != "both":  # (as tool calls: the first token is elsewhere)
            raise ValueError("--reasoning-parser is not supported with disaggregated prefill (--role) yet")
        self.reasoning_parser: type[ThinkParser] | None = REASONING_PARSERS.get(reasoning_parser or "")
        # Sequences (n per request) admitted and not finished: bounded, so a burst gets 429s, not an endless queue.
        max_num_seqs = engine.max_num_seqs
        self.capacity = max_num_seqs + max_queued_requests
        # Per request, so one request cannot take the whole capacity and leave every other client a 429.
        self.max_request_sequences = min(max_num_seqs if max_request_sequences is None else max_request_sequences,
                                         self.capacity)
        self.in_flight = 0
        # Its own threads, so that another model's long prompts cannot keep this one's requests from being tokenized.
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(tokenizer_threads, f"tokenize-{name}")
        # Answers with logprobs are built and encoded here (tens of MB take a second): not on the event loop, and not
        # on the tokenizing threads, where they would hold up other requests' prompts.
        self.responding = concurrent.futures.ThreadPoolExecutor(2, f"respond-{name}")

    def close(self) -> None:
        """Stops the model's threads (at shutdown: what is queued is dropped)."""
        for pool in (self.tokenizing, self.responding):
            pool.shutdown(wait=False, cancel_futures=True)

    @contextlib.contextmanager
    def admitted(self, seqs: int):
        """Holds `seqs` of the model's capacity for the block, or refuses the request: checked before anything
        costly."""
        if seqs > self.max_request_sequences:
            raise ApiError(400, f"{seqs} sequences (n x prompts) are more than one request may ask for on this "
                                f"server ({self.max_request_sequences})", "n")
        if self.in_flight + seqs > self.capacity:
            raise ApiError(429, "too many requests are queued; retry later", code="rate_limit_exceeded")
        self.in_flight += seqs
        try:
            yield
        finally:
            self.in_flight -= seqs

    def tokenized(self, prompt, params, add_special_tokens: bool = True) -> dict:
        """{"prompt_token_ids", "prompt"}, refused when prompt + max_tokens cannot fit max_model_len (as vLLM)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as an array of token ids", "prompt")
            self.fits_by_length(prompt, params)
            try:
                ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except ValueError as e:  # text no tokenizer takes (a lone surrogate from a chat template's other fields)
                raise ApiError(400, str(e)) from None
            prompt = {"prompt_token_ids": ids, "prompt": prompt}
        n, limit = len(prompt["prompt_token_ids"]), self.engine.max_model_len
        if n + (params.max_tokens or 1) > limit:
            raise context_length_error(limit, n, params.max_tokens)
        return prompt

    def fits_prompts(self, prompts: list, params) -> None:
        """Refuses a batch of prompts holding a text certainly too long (see fits_by_length), before admission."""
        for p in prompts:
            if isinstance(p, str):
                self.fits_by_length(p, params)

    def check_chat(self) -> None:
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids")

    def chat_params(self, params, tools):
        """A chat request's params for this model: refused if its tool calls cannot be parsed from this model's
        output; with tool_choice auto (or a reasoning parser) and tags that are special tokens, those are kept in
        the text (the parser reads them, as vLLM's parsers ask)."""
        parser = self.reasoning_parser
        if parser is not None and self.tokenizer is not None and tags_are_special(self.tokenizer,
                                                                                  (parser.start_tag, parser.end_tag)):
            params = dataclasses.replace(params, skip_special_tokens=False)
        if tools is None:
            return params
        self.tool_parser(tools)  # refused here, before anything runs, where the calls cannot be parsed
        if tools.choice == "auto" and tags_are_special(self.tokenizer, self.auto_tool_parser().TAGS):
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def auto_tool_parser(self) -> type:
        """The parser class of tool_choice auto on this model; a 400 where the server does not serve auto."""
        if not self.auto_tools.enabled:
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice (and --tool-call-parser '
                                'where the chat template\'s tool-call format is not recognised)', "tool_choice")
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        parser = tool_parser_class(self.auto_tools.parser, template)
        if parser is None:
            raise ApiError(400, '"auto" tool choice requires --tool-call-parser for this model (hermes, llama3_json, '
                                "mistral or qwen3_coder): its chat template's tool-call format is not recognised",
                           "tool_choice")
        return parser

    def tool_parser(self, tools):
        """A new parser of one choice's output for a request's tools (None: the output is plain content)."""
        try:
            return tools.parser(self.auto_tool_parser() if tools.choice == "auto" else None)
        except FieldError as e:
            raise ApiError(400, str(e), e.field) from None

    def reasoning_params(self, params, prompt: dict):
        """A chat request's params with its grammar (structured output, enforced tool calls) starting after the
        reasoning's end tag, unless the prompt has closed the block already (vLLM's reasoning_ended)."""
        parser, grammar = self.reasoning_parser, params.structured_outputs
        if parser is None or grammar is None or self.tokenizer is None or \
                parser.prompt_ends_reasoning(prompt.get("prompt") or ""):
            return params
        after = self.tokenizer.encode(parser.end_tag, add_special_tokens=False)
        return dataclasses.replace(params, structured_outputs=dataclasses.replace(grammar, starts_after=after))

    def fits_by_length(self, text: str, params) -> None:
        """Refuses a text certainly too long from its length alone: tokenizing 1 MB takes over a second."""
        min_tokens = getattr(self.tokenizer, "min_tokens", None)  # a stand-in tokenizer (tests) may state no bound
        if min_tokens is None:
            return
        floor, limit = min_tokens(text), self.engine.max_model_len
        if floor + (params.max_tokens or 1) > limit:
            raise context_length_error(limit, floor, params.max_tokens, at_least=True)

    async def off_loop(self, seqs: int, fn, *args, pool: concurrent.futures.Executor | None = None):
        """fn(*args) on one of the model's tokenizing threads (or `pool`'s), for work too heavy for the event loop. Runs
        within `admitted`: if the client leaves meanwhile, its `seqs` of capacity stay taken until the thread is done,
        so clients that send long prompts and leave cannot pile work up beyond the capacity."""
        future = asyncio.get_running_loop().run_in_executor(pool or self.tokenizing, fn, *args)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.in_flight += seqs  # `admitted` gives it back as the handler unwinds; the thread still works
            future.add_done_callback(lambda _: setattr(self, "in_flight", self.in_flight - seqs))
            raise
