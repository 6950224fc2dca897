"""A cascade behind the server (`jaxserve serve --model small --model large --cascade small,large`): a request whose
`model` is the cascade's name is answered by the cheapest tier its router lets keep it, and the answer names that
tier. The decision is `jaxserve.cascade.policy.choose_tier`; here is what asking a tier means on this server.

- before: tier i scores the prompt (`features.score_params`: one token, the prompt's own logprobs; with the prefix
  cache its generation then reuses the prompt's pages), and the chosen tier answers as if asked directly.
- after (whole answers): tier i answers, asked for the logprobs its judge reads on top of the client's (trimmed back
  before the client sees anything); kept, that answer is the response; else it is dropped and the next tier answers.
  The last tier runs the client's request unchanged, so an escalated answer is the one asking it directly gives.
- after, streamed: a stream cannot take back what it sent, so it is routed before generating, by the router's before
  classifiers if it has them, else to the last tier.

A tier too short for the request (prompt + max_tokens past its max_model_len) is skipped, not asked. A request of
several prompts, or n > 1, stays on a tier only if every prompt (before) or every choice (after) is kept. The
response's usage is the answering tier's; tokens spent on scoring passes and dropped answers show in each tier's own
metrics (and the cascade's routing seconds).
"""
from __future__ import annotations

import dataclasses
import time

from aiohttp import web

from jaxserve.cascade.features import (
    ANSWER_FEATURES,
    PROMPT_FEATURES,
    SCORE_TOPK,
    answer_features,
    prompt_features,
    score_params,
)
from jaxserve.cascade.policy import CascadeConfig, Route, choose_tier
from jaxserve.engine.client import EngineDeadError
from jaxserve.openai.errors import ApiError, ContextLengthError
from jaxserve.openai.metrics import ServerMetrics
from jaxserve.openai.requests import parse_chat, parse_completion
from jaxserve.openai.responses import new_id
from jaxserve.outputs import CompletionOutput, RequestOutput, merged
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.responses import CompletionResponse
from jaxserve.server.served_model import ServedModel


class ServedCascade:
    """One cascade over served models: its tiers (cheapest first), how it routes, and its metrics."""

    def __init__(self, config: CascadeConfig, models: dict[str, ServedModel], metrics: ServerMetrics):
        unknown = [t for t in config.tiers if t not in models]
        if unknown:
            raise ValueError(f"--cascade {','.join(config.tiers)}: {', '.join(map(repr, unknown))} is not a served "
                             f"model (served: {', '.join(models)})")
        if config.name in models:
            raise ValueError(f"--cascade-name {config.name!r} is a served model's name: the cascade needs its own")
        self.config, self.name, self.names = config, config.name, config.tiers
        self.tiers = [models[t] for t in config.tiers]
        self.judges, self.stream_judges = config.judges(), config.stream_judges()
        self.reads = config.reads()
        self.metrics = metrics.add_cascade(self.name, list(self.names))
        # Token-id prompts mean the same to every tier only if they share a vocabulary.
        self.shared_vocabulary = same_vocabulary(self.tiers)

    def surely_taking(self) -> ServedModel:
        """The tier whose max_model_len a request to the cascade may reach: the last one, as it answers whatever
        reaches it (a cheaper tier too short for a request is skipped)."""
        return self.tiers[-1]

    def tokenizing_model(self) -> ServedModel:
        """The model whose tokenizer the tokenizer endpoints use for the cascade's name: its tiers', if shared."""
        if not self.shared_vocabulary:
            raise ApiError(400, f"the tiers of the cascade `{self.name}` ({', '.join(self.names)}) tokenize "
                                f"differently: name one of them as the model", "model")
        return self.tiers[0]

    async def completions(self, server, request, body: dict, chat: bool) -> web.StreamResponse:
        """A /v1/completions (chat: /v1/chat/completions) request to the cascade, routed and answered."""
        # Refused here, once, while the server drains: a request taken before then is answered through every stage
        # (scoring, answers dropped, the answer), each taken by its tier's own admission, not the server's.
        if server.draining:
            raise ApiError(503, "the server is shutting down")
        routing = _Routing(self, server, request, body, chat)
        if self.config.policy == "after" and not routing.stream:
            return await routing.after()
        return await routing.before(self.judges if self.config.policy == "before" else self.stream_judges)


class _Routing:
    """One request to a cascade: its parsed body, each tier's tokenized prompts (made once, when the tier is first
    asked), and what the tiers said.

    A tier too short for the request (prompt + max_tokens past its max_model_len) is skipped: not asked, no
    escalation; the last tier answers whatever reaches it (too long for it: its 400)."""

    def __init__(self, cascade: ServedCascade, server, request, body: dict, chat: bool):
        self.cascade, self.server, self.request, self.body, self.chat = cascade, server, request, body, chat
        self.started = time.monotonic()
        if chat:
            self.messages, self.params, self.tools = parse_chat(body)
            self.num_prompts = 1
        else:
            self.prompts, self.params = parse_completion(body)
            self.tools = None
            if not cascade.shared_vocabulary and not all(isinstance(p, str) for p in self.prompts):
                raise ApiError(400, f"the tiers of the cascade `{cascade.name}` ({', '.join(cascade.names)}) have "
                                    f"different vocabularies: send text, or name one tier as the model for a prompt "
                                    f"of token ids", "prompt")
            self.num_prompts = len(self.prompts)
        self.seqs = self.params.n * self.num_prompts  # an answer's sequences (a scoring pass: one per prompt)
        self.stream = body.get("stream") is True
        self.id = new_id("cascade")
        self.prepared: dict[int, tuple[list[dict], SamplingParams]] = {}
        # after: tier -> its whole response body, and the response that encodes it (off the loop when heavy)
        self.answers: dict[int, tuple[CompletionResponse, dict]] = {}
        self.answer_started: dict[int, float] = {}

    async def _prepare(self, tier: int, seqs: int) -> tuple[list[dict], SamplingParams]:
        """Tier's tokenized prompts and params (a chat's may differ per tier: its tools' tags), made once. Within its
        admission of `seqs`. Raises ContextLengthError when the request is too long for the tier."""
        if tier not in self.prepared:
            m, server = self.cascade.tiers[tier], self.server
            if self.chat:
                m.check_chat()
                params = m.chat_params(self.params, self.tools)
                prompts = [await server.chat_prompt(m, self.messages, params, self.tools, seqs)]
            else:
                m.fits_prompts(self.prompts, self.params)
                params, prompts = self.params, await server.completion_prompts(m, self.prompts, self.params, seqs)
            self.prepared[tier] = prompts, params
        return self.prepared[tier]

    def _routed(self, route: Route, taken: float) -> None:
        """Counts the route once its tier has taken the request (admitted it, its prompts fit): a request refused
        there (429, 400) was answered by no tier."""
        self.cascade.metrics.routed(route.tier, route.escalations, taken - self.started)

    async def _answer_directly(self, route: Route) -> web.StreamResponse:
        """The route's tier answers the client's request as if asked by name."""
        m = self.cascade.tiers[route.tier]
        with m.admitted(self.seqs):
            prompts, params = await self._prepare(route.tier, self.seqs)
            self._routed(route, time.monotonic())
            return await self.server._generate(m, None, self.request, self.body, prompts, params, self.chat,
                                               self.tools)

    # ---- before: score the prompt with each tier until one keeps it ----

    async def before(self, judges) -> web.StreamResponse:
        last = len(self.cascade.tiers) - 1
        route = await choose_tier(judges, self._scores) if judges is not None else Route(last)
        return await self._answer_directly(route)

    async def _scores(self, tier: int) -> list[dict[str, float]] | None:
        """Each prompt's PROMPT_FEATURES under the tier's model, from one scoring pass each (one sequence, whatever
        the request's n); None if the request is too long for the tier."""
        m = self.cascade.tiers[tier]
        with m.admitted(self.num_prompts):
            try:
                prompts, _ = await self._prepare(tier, self.num_prompts)
            except ContextLengthError:
                return None
            run = _Run(f"{self.id}-score{tier}")
            async with self.server.running(m, None, run, self.body, prompts, score_params()) as outputs:
                answers = await _collected(outputs, len(prompts))
        return [prompt_features(out) for out in answers]

    # ---- after: each tier answers until one's answer is kept ----

    async def after(self) -> web.StreamResponse:
        if self.params.max_tokens == 0:
            raise ApiError(400, f"the cascade `{self.cascade.name}` judges answers (--cascade-policy after): "
                                f"max_tokens 0 leaves none to judge; name a model to score a prompt", "max_tokens")
        route = await choose_tier(self.cascade.judges, self._answer_features)
        if route.tier == len(self.cascade.tiers) - 1:
            return await self._answer_directly(route)
        self._routed(route, self.answer_started[route.tier])
        run, body = self.answers[route.tier]
        return await run.respond(body)

    async def _answer_features(self, tier: int) -> list[dict[str, float]] | None:
        """The tier answers (asked for what its judge reads), its response body is kept for the client, and each
        choice's features are returned; None if the request is too long for the tier."""
        m = self.cascade.tiers[tier]
        with m.admitted(self.seqs):
            try:
                prompts, params = await self._prepare(tier, self.seqs)
            except ContextLengthError:
                return None
            self.answer_started[tier] = time.monotonic()
            run = CompletionResponse(m, self.body, params, self.chat, len(prompts),
                                     self.server.stream_write_timeout_s, self.tools)
            engine_params = judged_params(params, self.cascade.reads)
            answers = [_Collected() for _ in prompts]
            async with self.server.running(m, None, run, self.body, prompts, engine_params) as outputs:
                self.answers[tier] = run, await run.whole_body(_as_asked(outputs, answers, params))
        return judged_features([a.output() for a in answers], self.cascade.reads)


def judged_params(params: SamplingParams, reads: set[str]) -> SamplingParams:
    """What a tier's engine is asked under the after policy: the client's params plus the logprobs its judge reads
    (prompt features: the prompt's own logprobs and the first token's top SCORE_TOPK; answer features: each token's
    own logprob). Sampling is unchanged: the tokens are those the client's request would get.

    Prompt features come from the answering request itself, not from a scoring pass before it: measured on the
    default model on this 2-core CPU (8 prompts of 93 tokens, 16 tokens each, one run on a shared machine), the
    widened request took 16.1 s against 12.5 s for the plain one, a scoring pass then the answer 25.1 s. (A request
    asking for prompt logprobs computes its prompt whole, without prefix-cache hits.)"""
    if reads & set(PROMPT_FEATURES):
        return dataclasses.replace(params, logprobs=max(params.logprobs or 0, SCORE_TOPK),
                                   prompt_logprobs=0 if params.prompt_logprobs is None else params.prompt_logprobs)
    if reads & set(ANSWER_FEATURES) and params.logprobs is None:
        return dataclasses.replace(params, logprobs=0)
    return params


def judged_features(answers: list[RequestOutput], reads: set[str]) -> list[dict[str, float]]:
    """One feature dict per choice of each prompt's whole output: its answer's features, and its prompt's when the
    judge reads them."""
    items = []
    for out in answers:
        prompt = prompt_features(out) if reads & set(PROMPT_FEATURES) else {}
        items += [{**prompt, **answer_features(c)} for c in out.outputs]
    return items


def as_asked(out: RequestOutput, params: SamplingParams) -> RequestOutput:
    """An output of a request widened by `judged_params`, as the client's own request (`params`) would have had it:
    no logprobs it did not ask for, no more top logprobs than it asked for, no prompt logprobs unasked."""
    outputs = [dataclasses.replace(c, logprobs=_top_n(c, params.logprobs),
                                   cumulative_logprob=c.cumulative_logprob if params.logprobs is not None else None)
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs,
                               prompt_logprobs=out.prompt_logprobs if params.prompt_logprobs is not None else None)


def _top_n(c: CompletionOutput, n: int | None):
    if n is None or c.logprobs is None:
        return None
    # The engine's entry: the top n (ranks 1..n) and the chosen token (its own rank): kept as a request for n has it.
    return [{t: lp for t, lp in entry.items() if t == token or (lp.rank is not None and lp.rank <= n)}
            for token, entry in zip(c.token_ids, c.logprobs)]


async def _as_asked(outputs, answers: list["_Collected"], params: SamplingParams):
    """(k, output) as they come, each recorded whole in answers[k] and passed on as the client asked it."""
    async for k, out in outputs:
        answers[k].add(out)
        yield k, as_asked(out, params)


class _Collected:
    """One engine request's outputs (deltas: vLLM's DELTA kind) put back together."""

    def __init__(self):
        self.last: RequestOutput | None = None
        self.prompt_logprobs = None
        self.choices: dict[int, CompletionOutput] = {}

    def add(self, out: RequestOutput) -> None:
        self.last = out
        if out.prompt_logprobs is not None:  # once, in the first output after they are whole
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:  # merged copies what it extends: the engine's outputs stay as they were sent
            whole = self.choices.get(c.index)
            self.choices[c.index] = merged([c] if whole is None else [whole, c])[0]

    def output(self) -> RequestOutput:
        out = self.last
        assert out is not None, "output() before any add()"
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                             [self.choices[i] for i in sorted(self.choices)], out.finished, out.metrics,
                             self.prompt_logprobs, num_cached_tokens=out.num_cached_tokens)


async def _collected(outputs, num_requests: int) -> list[RequestOutput]:
    """The merged outputs of `num_requests` engine requests, each whole once all are finished."""
    answers = [_Collected() for _ in range(num_requests)]
    try:
        async for k, out in outputs:
            answers[k].add(out)
    except EngineDeadError as e:
        raise ApiError(503, str(e)) from None
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - a failed engine step fails this request only (as a generation's would)
        raise ApiError(500, f"scoring the prompt failed: {type(e).__name__}: {e}") from None
    return [a.output() for a in answers]


@dataclasses.dataclass
class _Run:
    """What `Server.running` reads of a response for requests that make none (scoring passes): their id prefix, and
    nothing to count as aborted (a scoring pass is not a client's request)."""
    id: str
    finish: tuple = ()
    handed_off: object = None


def same_vocabulary(models: list[ServedModel]) -> bool:
    """Whether the models read token ids alike: the same vocabulary size, and no tokenizer or the same token for
    every id (checked once, at start)."""
    if len({m.engine.vocab_size for m in models}) != 1:
        return False
    tokenizers = [m.tokenizer for m in models]
    if all(t is None for t in tokenizers):
        return True
    if any(t is None for t in tokenizers):
        return False
    first = tokenizers[0]
    return all(t is first or (t.vocab_size == first.vocab_size and
                              all(t.id_to_token(i) == first.id_to_token(i) for i in range(first.vocab_size)))
               for t in tokenizers[1:])
