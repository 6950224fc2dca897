"""The host loop's decisions, re-made every step: who decodes, whose prompt advances by how much, who waits.

Each step, under a token budget (`max_num_batched_tokens`, grown up to `max_step_tokens` by queue depth:
`jaxserve.batching.token_budget`) and a sequence cap (`max_num_seqs`, or less when an SLO
policy says so):
  1. every running sequence past its prompt decodes one token, best priority first, and then any proposals it
     speculates (unless a waiting prompt's TTFT is at risk, which then keeps its first chunk's share of the budget
     from them: see jaxserve.batching.slo); one that needs a new page when none is left preempts the
     worst-priority, newest running sequence (perhaps itself: see jaxserve.batching.residency);
  2. the budget left goes to prompt chunks: running sequences still in prefill first, then waiting ones admitted in
     priority order once a slot and the pages for their whole prompt (less what the prefix cache holds) are free
     (jaxserve.batching.admission).
With async scheduling a step is planned before the previous one's tokens are known (see
`jaxserve.batching.engine_core`): a sequence may carry one in-flight token (`Sequence.pending`), which a decode row
then takes straight from the device. A row under a grammar (structured output) is the exception: its mask, filled
here for every such row at once, follows its latest token, so the engine reads a step holding one back before
planning the next (`ScheduledBatch.constrained`).

LoRA adapters: a waiting sequence whose adapter has no slot (all hold others' adapters, each used by a running
sequence) waits, and every adapter sequence after it waits too, so the slots drain to it rather than to a stream of
later requests for the adapters loaded already; base-model sequences need no slot and go on being admitted.

Disaggregated serving (`jaxserve.batching.pools.disaggregated`) splits a sequence's life over two schedulers. One with
role "prefill" runs prompts only: once a sequence's first token has landed (and did not end it), `update` moves it
out of `running` to `handed_off`, its pages held until the engine has exported them (`release_handed_off`), which
it does once a decode scheduler can take it (`can_take_prefilled`); while that first token is in flight, the
sequence gets no decode row. A decode scheduler takes it as `jaxserve.batching.admission` says.

The scheduler is the one writer of a Sequence's fields (its tokens, pages, slot, status and counters): `schedule`
lays a step's rows out and counts them in, `update` applies the step's result once the output processor has cut its
tokens at any stop, `finish` and `abort` take sequences out. It is this module with the two it builds on,
`jaxserve.batching.admission` and `jaxserve.batching.residency`; the step it hands the engine is
`jaxserve.batching.step_plan`'s, laid out as rows by `jaxserve.batching.step_rows`.
"""
from __future__ import annotations

from jaxserve.batching import output_processor
from jaxserve.batching.admission import Admission
from jaxserve.batching.output_processor import SequenceDelta
from jaxserve.batching.sequence import Sequence, Status
from jaxserve.batching.slo import SloController
from jaxserve.batching.speculation.proposer import Proposals
from jaxserve.batching.step_plan import Chunk, ScheduledBatch, Write
from jaxserve.batching.step_rows import constrain, lay_out_rows
from jaxserve.batching.token_budget import budget_for_queue
from jaxserve.buckets import round_up
from jaxserve.cache import PrefixCache, pages_needed
from jaxserve.lora.slot_cache import LoRASlots
from jaxserve.options import ROLES, SCHEDULING_POLICIES

# A waiting sequence gains one priority level per this many steps it waits, so a steady stream of better-priority
# requests cannot starve it.
AGING_STEPS = 64
# Below this many tokens a step reads weights more than it computes, so padding it is nearly free.
COMPUTE_BOUND_TOKENS = 64


class Scheduler(Admission):
    def __init__(self, cache: PrefixCache, max_num_seqs: int, max_num_batched_tokens: int,
                 token_buckets: tuple[int, ...] | None = None, policy: str = "fcfs",
                 slo: SloController | None = None, lora_slots: LoRASlots | None = None, role: str = "both",
                 max_step_tokens: int | None = None):
        """lora_slots: the runner's LoRA adapter slots (None: adapters are not enabled). role: "prefill" hands
        every sequence off after its first token (see the module's docstring). max_step_tokens: the most tokens a
        step may take when many prompts wait (default max_num_batched_tokens: a fixed budget)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        super().__init__(cache, max_num_seqs, policy, lora_slots)
        self.role = role
        self.max_num_batched_tokens = max_num_batched_tokens  # the budget with few prompts waiting
        self.max_step_tokens = max(max_step_tokens or max_num_batched_tokens, max_num_batched_tokens)
        self.token_buckets = token_buckets or (self.max_step_tokens,)  # the step sizes that compile, ascending
        self.slo = slo

    # ---- requests ----

    def has_unfinished(self) -> bool:
        """Sequences to run (not counting any handed off, which only wait to be taken)."""
        return bool(self.waiting or self.running)

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

    def schedule(self, num_draft: dict[Sequence, int] | None = None, propose=None) -> ScheduledBatch:
        """The next step, its rows laid out and counted in (its tokens computed, their samples in flight).

        num_draft: proposals wanted per decoding sequence (speculative decoding); granted where pages are free
        without preempting anyone and the token budget allows, after every sequence has its one decode token.
        propose(batch) -> Proposals: fills the grants (a Proposer's `propose`), before the rows are laid out.
        """
        plan = self._plan(num_draft)
        if plan and propose is not None:
            self._take_proposals(plan, propose(plan))
        plan.rows = lay_out_rows(plan)
        constrain(plan)
        self._count_in(plan)
        return plan

    def _plan(self, num_draft: dict[Sequence, int] | None) -> ScheduledBatch:
        plan = ScheduledBatch([], [])
        self._admitted_imports, self._admitted_loads = [], []
        reserved = self._prompt_reserve()
        preemptions = self.num_preemptions
        budget = self._plan_decodes(plan, self.step_budget(), reserved)
        if num_draft:
            budget = self._grant_proposals(plan, num_draft, budget, reserved)
        # Short of pages: a sequence admitted now would only be the next victim.
        admit = self.num_preemptions == preemptions
        for seq in sorted(self.running, key=self.priority):
            if budget > 0 and seq.num_to_compute > 1:
                budget -= self._add_chunks(plan, seq, budget)
        if admit:
            self._admit_waiting(plan, budget)
        # A priority preemption above may have taken out a sequence already planned.
        plan.decode = [s for s in plan.decode if s.status is Status.RUNNING]
        plan.num_draft = {s: k for s, k in plan.num_draft.items() if s.status is Status.RUNNING}
        plan.prefill = [c for c in plan.prefill if c.seq.status is Status.RUNNING]
        plan.imports = [i for i in self._admitted_imports if i[0].status is Status.RUNNING]
        plan.loads = [load for load in self._admitted_loads
                      if load.seq.status is Status.RUNNING and load.seq.num_preemptions == load.num_preemptions]
        plan.stores = self.cache.take_stores()
        for seq in self.waiting:
            seq.waited_steps += 1
            seq.boost = seq.waited_steps // AGING_STEPS
        self._fit_to_bucket(plan)
        # A decode row's proposals are left out: they may be rejected, and a page holding a rejected token must
        # never be published. Accepted ones are published with the step that next writes after them.
        plan.writes = [Write(s, s.num_tokens, s.num_preemptions) for s in plan.decode] + \
                      [Write(c.seq, c.start + c.length, c.seq.num_preemptions) for c in plan.prefill]
        return plan

    def step_budget(self) -> int:
        """This step's token budget, by the prompts waiting to be computed: running ones still in prefill, and
        waiting ones as far as there are slots to admit them into."""
        prefilling = sum(1 for s in self.running if s.num_to_compute > 1)
        depth = prefilling + min(len(self.waiting), len(self._free_slots))
        return budget_for_queue(depth, self.max_num_batched_tokens, self.max_step_tokens)

    def _plan_decodes(self, plan: ScheduledBatch, budget: int, reserved: int) -> int:
        """One decode token for each running sequence past its prompt, best priority first, a page grown for it
        where needed; returns the budget left."""
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
        return budget

    def _grant_proposals(self, plan: ScheduledBatch, num_draft: dict[Sequence, int], budget: int,
                         reserved: int) -> int:
        """The proposals each decoding sequence may have: what it asked for, as far as the budget (less the
        reserve), its length limit and the free pages allow (no one is preempted for a proposal); returns the
        budget left."""
        for seq in plan.decode:
            k = min(num_draft.get(seq, 0), budget - reserved, seq.max_total_tokens - seq.num_tokens)
            while k > 0 and pages_needed(seq.num_tokens + k, self.page_size) - len(seq.pages) > \
                    self.cache.num_available:
                k -= 1
            if k > 0 and seq.status is Status.RUNNING:
                self._grow(seq, seq.num_tokens + k)
                plan.num_draft[seq] = k
                budget -= k
        return budget

    def _admit_waiting(self, plan: ScheduledBatch, budget: int) -> None:
        """Admits waiting sequences in priority order while the budget lasts, each with its first prompt chunk."""
        cap = self.max_num_seqs if self.slo is None else min(self.max_num_seqs, self.slo.batch_cap(self.waiting))
        slot_short = False  # an adapter sequence waits for a LoRA slot: later adapter sequences wait behind it
        for seq in sorted(self.waiting, key=self.priority):
            if budget <= 0:
                break
            if seq.pending:
                continue  # preempted with a token in flight: resumable once it lands
            if not self._importable(seq):
                continue  # its KV is still on its way, or another import goes first this step
            if seq.lora is not None and (slot_short or not self._adapter_slots().can_take(seq.lora)):
                slot_short = True
                continue
            if not self._admit(seq, cap):
                break
            budget -= self._add_chunks(plan, seq, budget)

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
                oldest.lora is not None and not self._adapter_slots().can_take(oldest.lora)):
            return 0  # it could not run this step: the decodes keep the budget (a prefix hit may fit it later)
        return min(oldest.num_to_compute, self.max_num_batched_tokens // 2)

    def _take_proposals(self, plan: ScheduledBatch, proposals: Proposals) -> None:
        plan.proposals = proposals.tokens
        plan.num_draft = {s: len(p) for s, p in proposals.tokens.items()}
        for seq, n in proposals.draft_cached.items():
            seq.num_draft_cached = n

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

    def _count_in(self, plan: ScheduledBatch) -> None:
        """Its rows read, the batch's tokens count as computed and their samples as in flight (a step that then
        fails to run ends every sequence in it)."""
        for seq in plan.decode:
            seq.num_cached += 1 + len(plan.proposals.get(seq, ()))
            seq.pending += 1
        for chunk in plan.prefill:
            chunk.seq.num_cached += chunk.length
            chunk.seq.pending += chunk.is_last

    # ---- applying a step ----

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
            if seq.first_token_time is None and d.token_ids:  # one ended with no token (an error) took none
                seq.first_token_time = now
            if d.finished:
                seq.finish_time = now
                self.finish(seq)
            elif seq in batch.proposals:
                self._roll_back(seq, len(batch.proposals[seq]) - (d.num_emitted - 1))
            elif self.role == "prefill" and seq.status is Status.RUNNING:
                # One preempted while its first token was in flight recomputes, and is handed off after that.
                self._hand_off(seq)
