"""The host loop's decisions, re-made every step: who decodes, whose prompt advances by how much, who waits.

Each step, under a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`, or less when an SLO
policy says so):
  1. every running sequence past its prompt decodes one token, best priority first, and then any proposals it
     speculates (unless a waiting prompt's TTFT is at risk, which then keeps its first chunk's share of the budget
     from them: see jaxserve.batching.slo); one that needs a new page when none is left preempts the
     worst-priority, newest running sequence (perhaps itself): its pages go back (full ones stay in the prefix
     cache) and it is later recomputed from its tokens;
  2. the budget left goes to prompt chunks: running sequences still in prefill first, then waiting ones admitted in
     priority order once a slot and the pages for their whole prompt (less what the prefix cache holds) are free.
With async scheduling a step is planned before the previous one's tokens are known (see
`jaxserve.batching.engine_core`): a sequence may carry one in-flight token (`Sequence.pending`), which a decode row
then takes straight from the device. A row under a grammar (structured output) is the exception: its mask, filled
here for every such row at once, follows its latest token, so the engine reads a step holding one back before
planning the next (`ScheduledBatch.constrained`).

LoRA adapters (`lora_slots`): a running sequence with an adapter holds one of the runner's adapter slots, so a step
never has more distinct adapters than slots. A waiting sequence whose adapter has no slot (all hold others' adapters,
each used by a running sequence) waits, and every adapter sequence after it waits too, so the slots drain to it
rather than to a stream of later requests for the adapters loaded already; base-model sequences need no slot and go
on being admitted.

Disaggregated serving (`jaxserve.batching.pools.disaggregated`) splits a sequence's life over two schedulers. One with
role "prefill" runs prompts only: once a sequence's first token has landed (and did not end it), `update` moves it
out of `running` to `handed_off`, its pages held until the engine has exported them (`release_handed_off`), which
it does once a decode scheduler can take it (`can_take_prefilled`); while that first token is in flight, the
sequence gets no decode row. A decode scheduler (role "decode", or "both") takes
such a sequence with its KV pages (`add_prefilled`): it waits like any other, and once a slot and pages for all its
tokens are free it is admitted with its prompt counted as computed and the pages to import listed in the step
(`ScheduledBatch.imports`), which the engine writes into the cache before the step runs; then it decodes as any
other, and a preemption later recomputes it from its tokens as usual.

The scheduler is the one writer of a Sequence's fields (its tokens, pages, slot, status and counters): `schedule`
lays a step's rows out and counts them in, `update` applies the step's result once the output processor has cut its
tokens at any stop, `finish` and `abort` take sequences out.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from jaxserve.runner.batch_builder import Row, RowSampling
from jaxserve.batching import output_processor
from jaxserve.batching.output_processor import SequenceDelta
from jaxserve.batching.speculation.proposer import Proposals
from jaxserve.batching.sequence import Sequence, Status
from jaxserve.batching.slo import SloController
from jaxserve.buckets import round_up
from jaxserve.cache import PrefixCache, page_keys, pages_needed
from jaxserve.cache.transfer import KVPages
from jaxserve.sample.logit_controls import bad_word_bans
from jaxserve.lora.slot_cache import LoRASlots
from jaxserve.options import ROLES, SCHEDULING_POLICIES
from jaxserve.structured_output import fill_masks
from jaxserve.sample.token_mask import both

# A waiting sequence gains one priority level per this many steps it waits, so a steady stream of better-priority
# requests cannot starve it.
AGING_STEPS = 64
# Below this many tokens a step reads weights more than it computes, so padding it is nearly free.
COMPUTE_BOUND_TOKENS = 64


@dataclasses.dataclass
class Chunk:
    seq: Sequence
    start: int  # first token of the chunk (tokens before it are cached)
    length: int

    @property
    def is_last(self) -> bool:
        """The chunk reaches the sequence's end, so its sampled token is the next one."""
        return self.start + self.length == len(self.seq.token_ids)


@dataclasses.dataclass
class Write:
    """Tokens of a sequence whose K/V a step writes: published to the prefix cache only after the step has
    completed, and only if the sequence was not preempted since (its pages went back)."""
    seq: Sequence
    end: int  # tokens of it cached once the step has run
    num_preemptions: int  # its preemption count when the step was scheduled


@dataclasses.dataclass
class ScheduledBatch:
    decode: list[Sequence]  # one token each, and any proposals after it
    prefill: list[Chunk]  # at most one chunk per sequence
    # Speculative decoding: how many proposals a decoding sequence has pages and budget for, then the proposals
    # themselves (at most that many; see jaxserve.batching.speculation.proposer).
    num_draft: dict[Sequence, int] = dataclasses.field(default_factory=dict)
    proposals: dict[Sequence, list[int]] = dataclasses.field(default_factory=dict)
    writes: list[Write] = dataclasses.field(default_factory=list)
    # The step's rows, laid out once the batch is complete: decode rows, then prompt chunks.
    rows: list[Row] = dataclasses.field(default_factory=list)
    constrained: bool = False  # a row samples under a grammar: the next step needs this one's tokens to plan
    # Sequences prefilled elsewhere and admitted now: (the sequence, its first pages, the KV to write there before
    # the step).
    imports: list[tuple[Sequence, list[int], KVPages]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    def drop(self, request_ids: set[str]) -> None:
        """Takes these requests' rows out, before the step is dispatched (their sequences were taken out since)."""
        def kept(seq: Sequence) -> bool:
            return seq.request_id not in request_ids
        self.rows = [row for row, seq in zip(self.rows, self.row_seqs) if kept(seq)]
        self.decode = [s for s in self.decode if kept(s)]
        self.prefill = [c for c in self.prefill if kept(c.seq)]
        self.num_draft = {s: k for s, k in self.num_draft.items() if kept(s)}
        self.proposals = {s: p for s, p in self.proposals.items() if kept(s)}
        self.writes = [w for w in self.writes if kept(w.seq)]
        self.imports = [i for i in self.imports if kept(i[0])]

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(self.num_draft.values()) + sum(c.length for c in self.prefill)

    @property
    def row_seqs(self) -> list[Sequence]:
        """Each row's sequence, in the rows' order."""
        return self.decode + [c.seq for c in self.prefill]


def prompt_targets(chunk: Chunk) -> dict:
    """A prompt chunk's Row arguments for prompt logprobs: each position from the first not yet collected (a
    recomputed chunk asks only for what is missing) scores the prompt token after it; the last prompt token has
    none. Empty when the sequence does not score its prompt."""
    seq = chunk.seq
    if not seq.scores_prompt:
        return {}
    prompt = seq.prompt_token_ids
    first = max(chunk.start, len(seq.output.prompt_logprobs) - 1)
    end = min(chunk.start + chunk.length, len(prompt) - 1)
    if first >= end:
        return {}
    return dict(prompt_targets=prompt[first + 1:end + 1], score_from=first - chunk.start)


def row_sampling(seq: Sequence, ahead: int = 0, top_logprobs: bool = True) -> RowSampling:
    """How a row of `seq` samples its next token, or (a draft model's row) the token `ahead` tokens later: with its
    seed and generated token number, so a draft's draw is coupled with the target's. top_logprobs=False: a row whose
    logprobs nobody reads (a draft's)."""
    p = seq.params
    # min_tokens: until reached, ending tokens may not be sampled at all (a device-side ban, as in vLLM; the
    # device counts, since one verification row samples several tokens).
    banned = seq.ending_token_ids if seq.num_generated < p.min_tokens else ()
    c = seq.controls
    bans = bad_word_bans(c.bad_words, seq.output_token_ids, seq.num_generated) if c.bad_words else ()
    return RowSampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seq.seed,
                       step=seq.num_generated + ahead, banned=banned, min_tokens=p.min_tokens,
                       want_top_logprobs=bool(p.logprobs) and top_logprobs,
                       # Logit controls: the request's mask and bias (resolved at admission), the bad words the
                       # row's last token may complete, the penalties and the tokens they count.
                       token_mask=c.token_mask, bad_word_bans=bans, logit_bias=c.logit_bias,
                       presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                       repetition_penalty=p.repetition_penalty, past_tokens=seq.token_ids_array,
                       prompt_len=len(seq.prompt_token_ids))


class Scheduler:
    def __init__(self, cache: PrefixCache, max_num_seqs: int, max_num_batched_tokens: int,
                 token_buckets: tuple[int, ...] | None = None, policy: str = "fcfs",
                 slo: SloController | None = None, lora_slots: LoRASlots | None = None, role: str = "both"):
        """lora_slots: the runner's LoRA adapter slots (None: adapters are not enabled). role: "prefill" hands
        every sequence off after its first token (see the module's docstring)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.handed_off: list[Sequence] = []  # prefilled, pages held until exported
        # Waiting prefilled sequences: (tokens cached, KV, when added, whether the KV has landed); how many were
        # admitted, after how long.
        self._imports: dict[Sequence, tuple[int, KVPages, float, Callable[[], bool]]] = {}
        self.num_prefilled_admitted, self.prefilled_wait_seconds = 0, 0.0
        self._admitted_imports: list[tuple[Sequence, list[int], KVPages]] = []  # while planning a step
        self.cache = cache
        self.page_size = cache.page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.token_buckets = token_buckets or (max_num_batched_tokens,)  # the step sizes that compile, ascending
        self.policy = policy
        self.slo = slo
        self.lora_slots = lora_slots
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    # ---- requests ----

    def check_fits(self, seq: Sequence) -> None:
        need = pages_needed(seq.max_total_tokens, self.page_size)
        if need > self.cache.allocator.num_usable:
            raise ValueError(f"a sequence of up to {seq.max_total_tokens} tokens needs {need} KV pages "
                             f"but the cache has {self.cache.allocator.num_usable}; lower max_tokens or raise the "
                             "KV budget")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        if seq.lora is not None and self.lora_slots is None:
            raise ValueError(f"request {seq.request_id} names LoRA adapter {seq.lora.request.lora_name!r}, but this "
                             "engine was started without enable_lora")
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence, num_cached: int, kv: KVPages, first_token: int | None = None,
                      landed: Callable[[], bool] = lambda: True) -> None:
        """A sequence prefilled elsewhere: its first num_cached tokens' K/V are kv's pages, its first token taken
        (first_token: taken here, for a sequence built here; the output processor has said it already). It waits,
        holding only kv, until kv has landed (`landed()`: a step that imports it then never waits for the devices
        it comes from) and a slot and pages for all its tokens are free."""
        if first_token is not None and not seq.output_token_ids:
            if seq.token_ids_array is not None:
                seq.token_ids_array[len(seq.prompt_token_ids)] = first_token
            seq.output_token_ids.append(first_token)
            seq.first_token_time = time.monotonic()
        if not seq.output_token_ids or seq.pending or num_cached != seq.num_tokens - 1:
            raise ValueError(f"request {seq.request_id}: a prefilled sequence has its first token and the K/V of "
                             f"every token before it ({seq.num_tokens - 1}), got {num_cached}")
        if seq.lora is not None:
            raise ValueError(f"request {seq.request_id}: LoRA adapters are not supported with disaggregated prefill")
        self.add(seq)
        self._imports[seq] = (num_cached, kv, time.monotonic(), landed)

    def can_take_prefilled(self, seq: Sequence) -> bool:
        """A prefilled sequence given now would be admitted at once (once its KV has landed): a slot and pages for
        its tokens are free after every waiting sequence (prefilled ones landing, preempted ones) has had its own."""
        promised = sum(pages_needed(q.num_tokens, self.page_size) for q in self.waiting)
        return (len(self.running) + len(self.waiting) < self.max_num_seqs
                and promised + pages_needed(seq.num_tokens, self.page_size) <= self.cache.num_available)

    def has_unfinished(self) -> bool:
        """Sequences to run (not counting any handed off, which only wait to be taken)."""
        return bool(self.waiting or self.running)

    def awaits_kv(self) -> bool:
        """A prefilled sequence waits for its KV to land."""
        return any(not landed() for _, _, _, landed in self._imports.values())

    def abort(self, request_id: str) -> list[Sequence]:
        aborted = [s for s in self.waiting + self.running + self.handed_off if s.request_id == request_id]
        for seq in aborted:
            self.finish(seq)
        return aborted

    def finish(self, seq: Sequence) -> None:
        """Takes a sequence out for good (done or aborted); its pages and slot are free for the next step."""
        if seq.status is Status.RUNNING:
            self._take_out(seq)
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self._imports.pop(seq, None)
        elif seq.status is Status.HANDED_OFF and seq in self.handed_off:  # not yet taken: its pages go back
            self.release_handed_off(seq)
        seq.status = Status.FINISHED
        output_processor.free_grammar(seq)

    # ---- planning a step ----

    def priority(self, seq: Sequence):
        return seq.effective_priority if self.policy == "priority" else (0, seq.arrival)

    def schedule(self, num_draft: dict[Sequence, int] | None = None, propose=None) -> ScheduledBatch:
        """The next step, its rows laid out and counted in (its tokens computed, their samples in flight).

        num_draft: proposals wanted per decoding sequence (speculative decoding); granted where pages are free
        without preempting anyone and the token budget allows, after every sequence has its one decode token.
        propose(batch) -> Proposals: fills the grants (a Proposer's `propose`), before the rows are laid out.
        """
        plan = self._plan(num_draft)
        if plan and propose is not None:
            self._take_proposals(plan, propose(plan))
        plan.rows = self._rows(plan)
        self._constrain(plan)
        self._count_in(plan)
        return plan

    def _plan(self, num_draft: dict[Sequence, int] | None) -> ScheduledBatch:
        plan = ScheduledBatch([], [])
        self._admitted_imports: list[tuple[Sequence, list[int], KVPages]] = []
        budget = self.max_num_batched_tokens
        reserved = self._prompt_reserve()
        preemptions = self.num_preemptions
        for seq in sorted(self.running, key=self.priority):
            if seq.status is not Status.RUNNING or seq.num_to_compute != 1 or seq.reached_length_limit:
                continue  # preempted just now, still in prefill, or ends when its in-flight token lands
            if self.role == "prefill" and seq.num_generated:
                continue  # its first token is in flight: handed off once it lands, never decoded here
            if budget <= reserved:
                break  # the rest decode next step: a prompt whose TTFT is at risk goes first
            if self._grow(seq, seq.num_tokens):
                plan.decode.append(seq)
                budget -= 1
        for seq in plan.decode if num_draft else []:
            k = min(num_draft.get(seq, 0), budget - reserved, seq.max_total_tokens - seq.num_tokens)
            while k > 0 and pages_needed(seq.num_tokens + k, self.page_size) - len(seq.pages) > \
                    self.cache.num_available:
                k -= 1
            if k > 0 and seq.status is Status.RUNNING:
                self._grow(seq, seq.num_tokens + k)
                plan.num_draft[seq] = k
                budget -= k
        # Short of pages: a sequence admitted now would only be the next victim.
        admit = self.num_preemptions == preemptions
        for seq in sorted(self.running, key=self.priority):
            if budget > 0 and seq.num_to_compute > 1:
                budget -= self._add_chunks(plan, seq, budget)
        cap = self.max_num_seqs if self.slo is None else min(self.max_num_seqs, self.slo.batch_cap(self.waiting))
        slot_short = False  # an adapter sequence waits for a LoRA slot: later adapter sequences wait behind it
        for seq in sorted(self.waiting, key=self.priority) if admit else []:
            if budget <= 0:
                break
            if seq.pending:
                continue  # preempted with a token in flight: resumable once it lands
            if seq in self._imports and not self._imports[seq][3]():
                continue  # its KV is still on its way
            if seq.lora is not None and (slot_short or not self.lora_slots.can_take(seq.lora)):
                slot_short = True
                continue
            if not self._admit(seq, cap):
                break
            budget -= self._add_chunks(plan, seq, budget)
        # A priority preemption above may have taken out a sequence already planned.
        plan.decode = [s for s in plan.decode if s.status is Status.RUNNING]
        plan.num_draft = {s: k for s, k in plan.num_draft.items() if s.status is Status.RUNNING}
        plan.prefill = [c for c in plan.prefill if c.seq.status is Status.RUNNING]
        plan.imports = [i for i in self._admitted_imports if i[0].status is Status.RUNNING]
        for seq in self.waiting:
            seq.waited_steps += 1
            seq.boost = seq.waited_steps // AGING_STEPS
        self._fit_to_bucket(plan)
        # A decode row's proposals are left out: they may be rejected, and a page holding a rejected token must
        # never be published. Accepted ones are published with the step that next writes after them.
        plan.writes = [Write(s, s.num_tokens, s.num_preemptions) for s in plan.decode] + \
                      [Write(c.seq, c.start + c.length, c.seq.num_preemptions) for c in plan.prefill]
        return plan

    def _prompt_reserve(self) -> int:
        """Tokens of the step kept from the decodes and proposals for the oldest prompt still awaiting its first
        token, when its TTFT is at risk (see jaxserve.batching.slo) and it can be admitted now (a slot, pages for
        its prompt, its adapter's slot): its first chunk, at most half the budget. 0 otherwise. Preempted and
        prefilled-elsewhere sequences said their first token already; they wait as any other."""
        if self.slo is None or not self._free_slots:
            return 0
        fresh = [s for s in self.waiting if not s.output_token_ids and not s.pending and s not in self._imports]
        if not self.slo.ttft_at_risk(fresh):
            return 0
        oldest = min(fresh, key=lambda s: s.arrival_time)
        if pages_needed(len(oldest.token_ids), self.page_size) > self.cache.num_available or (
                oldest.lora is not None and not self.lora_slots.can_take(oldest.lora)):
            return 0  # it could not run this step: the decodes keep the budget (a prefix hit may fit it later)
        return min(oldest.num_to_compute, self.max_num_batched_tokens // 2)

    def _take_proposals(self, plan: ScheduledBatch, proposals: Proposals) -> None:
        plan.proposals = proposals.tokens
        plan.num_draft = {s: len(p) for s, p in proposals.tokens.items()}
        for seq, n in proposals.draft_cached.items():
            seq.num_draft_cached = n

    @staticmethod
    def _rows(plan: ScheduledBatch) -> list[Row]:
        """The batch as rows, from the sequences as they stand before it is counted in: decode rows (whose token the
        step before sampled is taken straight from the device), then prompt chunks."""
        rows = []
        for s in plan.decode:
            proposals = plan.proposals.get(s, [])
            rows.append(Row([0 if s.pending else s.last_token] + proposals, s.num_tokens - 1, s.pages,
                            row_sampling(s), s.slot, chained=bool(s.pending), num_draft=len(proposals),
                            lora_slot=s.lora_slot))
        rows += [Row(c.seq.token_ids[c.start:c.start + c.length], c.start, c.seq.pages, row_sampling(c.seq),
                     c.seq.slot if c.is_last else -1, samples=c.is_last, lora_slot=c.seq.lora_slot,
                     **prompt_targets(c))
                 for c in plan.prefill]
        return rows

    @staticmethod
    def _constrain(plan: ScheduledBatch) -> None:
        """Fills the masks of the rows that sample under a grammar, all at once (llguidance's threads, without the
        GIL), each ANDed with any mask the row has already."""
        constrained = [(row, seq.output.grammar) for row, seq in zip(plan.rows, plan.row_seqs)
                       if row.samples and seq.output.grammar is not None]
        if not constrained:
            return
        if any(row.chained for row, _ in constrained):  # the engine reads such a row's last step back first
            raise RuntimeError("a row under a grammar was planned before its previous token was known")
        masks = fill_masks([grammar for _, grammar in constrained])  # [R, W]
        for (row, _), mask in zip(constrained, masks):
            row.sampling.token_mask = both(row.sampling.token_mask, mask)
        plan.constrained = True

    def _count_in(self, plan: ScheduledBatch) -> None:
        """Its rows read, the batch's tokens count as computed and their samples as in flight (a step that then
        fails to run ends every sequence in it)."""
        for seq in plan.decode:
            seq.num_cached += 1 + len(plan.proposals.get(seq, ()))
            seq.pending += 1
        for chunk in plan.prefill:
            chunk.seq.num_cached += chunk.length
            chunk.seq.pending += chunk.is_last

    def update(self, batch: ScheduledBatch, deltas: list[SequenceDelta], now: float) -> None:
        """Applies a completed step: its pages are published, each sequence takes the tokens the output processor
        took for it, and one that ended is finished; a verification row's rejected proposals are rolled back."""
        self._written(batch)
        for d in deltas:
            seq = d.seq
            seq.pending -= 1  # a row's tokens land together
            if seq.token_ids_array is not None:
                end = len(seq.prompt_token_ids) + len(seq.output_token_ids)
                seq.token_ids_array[end:end + len(d.token_ids)] = d.token_ids
            seq.output_token_ids += d.token_ids
            if seq.first_token_time is None:
                seq.first_token_time = now
            if d.finished:
                seq.finish_time = now
                self.finish(seq)
            elif seq in batch.proposals:
                self._roll_back(seq, len(batch.proposals[seq]) - (d.num_emitted - 1))
            elif self.role == "prefill" and seq.status is Status.RUNNING:
                # One preempted while its first token was in flight recomputes, and is handed off after that.
                self._hand_off(seq)

    def _hand_off(self, seq: Sequence) -> None:
        """Its prompt computed and first token taken: out of the batch, its pages held for the export."""
        self._free_slots.append(seq.slot)
        seq.slot = None
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1
        self.running.remove(seq)
        seq.status = Status.HANDED_OFF
        self.handed_off.append(seq)

    def release_handed_off(self, seq: Sequence) -> None:
        """A handed-off sequence's pages go back (their export dispatched first: JAX runs a later step that
        reuses them after it); full ones stay in the prefix cache. Its status is the taker's to set."""
        self.handed_off.remove(seq)
        self.cache.release(seq.pages)
        seq.pages, seq.num_cached, seq.num_written, seq.num_published, seq.num_draft_cached = [], 0, 0, 0, 0

    def _written(self, plan: ScheduledBatch) -> None:
        """After `plan`'s step has completed: its full pages are in the cache, so the prefix cache may serve them.

        Never earlier: a step that fails on the device leaves pages that were never written, which must not be
        served as cached prefixes. A sequence preempted since the step was planned has given those pages back.
        """
        for w in plan.writes:
            if w.seq.status is Status.RUNNING and w.seq.num_preemptions == w.num_preemptions:
                w.seq.num_written = max(w.seq.num_written, w.end)
                self.publish(w.seq)

    def _roll_back(self, seq: Sequence, num_rejected: int) -> None:
        """After a verification step: the rejected proposals' K/V stay in the cache unread, past the sequence's
        length, to be overwritten; pages holding nothing but them go back."""
        seq.num_cached -= num_rejected
        seq.num_draft_cached = min(seq.num_draft_cached, seq.num_cached)
        keep = pages_needed(seq.num_tokens, self.page_size)  # the next step writes the last token's K/V
        if len(seq.pages) > keep:
            self.cache.release(seq.pages[keep:])
            del seq.pages[keep:]

    def publish(self, seq: Sequence) -> None:
        """Tells the prefix cache about the sequence's pages that completed steps have filled."""
        full = seq.num_written // self.page_size
        if full > seq.num_published:
            keys = page_keys(seq.token_ids[:full * self.page_size], self.page_size, seq.page_keys, seq.prefix_salt)
            self.cache.publish(seq.pages, seq.token_ids, keys[:full], seq.num_published)
            seq.num_published = full

    def _add_chunks(self, plan: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Plans up to `budget` of the sequence's next prompt tokens, as one chunk; returns how many."""
        n = min(seq.num_to_compute, budget)
        plan.prefill.append(Chunk(seq, seq.num_cached, n))
        return n

    def _fit_to_bucket(self, plan: ScheduledBatch) -> None:
        """Cuts prompt chunks (the last planned first) down to the bucket below when the step would otherwise pad
        more than a quarter of the bucket above: a padded token costs a real one in every matmul once a step is
        compute-bound, while a cut token only waits a step. Decode tokens are never cut."""
        total = plan.num_tokens
        if total == 0:
            return
        above = round_up(total, self.token_buckets)
        below = max((b for b in self.token_buckets if b < total), default=0)
        decode_tokens = len(plan.decode) + sum(plan.num_draft.values())
        if above <= COMPUTE_BOUND_TOKENS or above - total <= above // 4 or below < max(decode_tokens, 1):
            return
        excess = total - below
        while excess > 0:
            chunk = plan.prefill[-1]
            cut = min(excess, chunk.length)
            chunk.length -= cut
            excess -= cut
            if chunk.length == 0:
                plan.prefill.pop()

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives `seq` pages for num_tokens, preempting worse sequences (or `seq`) if none are free."""
        need = pages_needed(num_tokens, self.page_size) - len(seq.pages)
        while need > self.cache.num_available:
            victim = max(self.running, key=self.priority)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages += self.cache.allocate(need)
        return True

    def _admit(self, seq: Sequence, cap: int) -> bool:
        """Gives a waiting sequence a slot, its adapter's slot (the caller saw one can be had), its cached prefix,
        and pages for all its tokens; False if it must wait."""
        # The adapter slot first: loading it is the step that can fail, and then nothing else is held yet.
        lora_slot = self.lora_slots.take(seq.lora) if seq.lora is not None else -1
        admitted = False
        try:
            admitted = self._admit_pages(seq, cap)
        finally:
            if lora_slot >= 0 and not admitted:  # it keeps the adapter for the next try; nobody counts as using it
                self.lora_slots.release(lora_slot)
        if admitted:
            seq.lora_slot = lora_slot
        return admitted

    def _admit_pages(self, seq: Sequence, cap: int) -> bool:
        """_admit once its adapter has a slot: a slot in the batch, the cached prefix and pages."""
        if seq in self._imports:
            return self._admit_prefilled(seq, cap)
        while True:
            if len(self.running) < cap:
                tokens = seq.token_ids
                keys = page_keys(tokens[:len(tokens) - 1], self.page_size, seq.page_keys, seq.prefix_salt)
                # At least the last token is computed, whatever is cached: its logits give the next token. A
                # sequence scoring its prompt computes all of it (its pages are still published).
                hit = self.cache.match(tokens, keys, 0 if seq.scores_prompt else (len(tokens) - 1) // self.page_size)
                need = pages_needed(len(tokens), self.page_size) - len(hit)
                if need <= self.cache.num_available:
                    break
                self.cache.release(hit)
            if not self._preempt_for(seq, cap):
                return False
        seq.pages = hit + self.cache.allocate(need)
        seq.num_cached = seq.num_written = len(hit) * self.page_size
        seq.num_published = len(hit)
        if not seq.scores_prompt:
            self.cache.count_lookup(len(tokens), len(hit) * self.page_size)
        self._start(seq)
        return True

    def _admit_prefilled(self, seq: Sequence, cap: int) -> bool:
        """A prefilled sequence: pages for all its tokens, the first ones to be written from its KV before the
        step; only its first token (the next step's input) is left to compute."""
        need = pages_needed(seq.num_tokens, self.page_size)
        while len(self.running) >= cap or need > self.cache.num_available:
            if not self._preempt_for(seq, cap):
                return False
        num_cached, kv, added, _ = self._imports.pop(seq)
        self.num_prefilled_admitted += 1
        self.prefilled_wait_seconds += time.monotonic() - added
        seq.pages = self.cache.allocate(need)
        # Written once the import has run, which comes before any step that reads or publishes them.
        seq.num_cached = seq.num_written = num_cached
        seq.num_published = 0
        self._admitted_imports.append((seq, seq.pages[:pages_needed(num_cached, self.page_size)], kv))
        self._start(seq)
        return True

    def _start(self, seq: Sequence) -> None:
        seq.status = Status.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        seq.slot = self._free_slots.pop()
        self.waiting.remove(seq)
        self.running.append(seq)

    def _preempt_for(self, seq: Sequence, cap: int) -> bool:
        """Under the priority policy, a waiting sequence displaces a strictly worse running one, if one is enough."""
        if self.policy != "priority" or not self.running or len(self.running) > cap:
            return False
        victim = max(self.running, key=self.priority)
        if self.priority(victim)[0] <= self.priority(seq)[0]:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._take_out(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def _take_out(self, seq: Sequence) -> None:
        # No publishing here: what completed steps filled is published already, and what is still in flight may
        # never be written.
        self.cache.release(seq.pages)
        seq.pages, seq.num_cached, seq.num_written, seq.num_published, seq.num_draft_cached = [], 0, 0, 0, 0
        self._free_slots.append(seq.slot)
        seq.slot = None
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1
