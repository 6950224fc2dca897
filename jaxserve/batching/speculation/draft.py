"""Draft-model proposals: a small model sharing the target's tokenizer guesses k tokens, one step per token.

The draft has its own paged KV cache, indexed by the target's page ids: a sequence's pages hold its K/V in both
caches, so pages are allocated, freed, preempted and rolled back once, for both models. The draft computes a
sequence's tokens only when it is asked to speculate for it (`Sequence.num_draft_cached` says how far it got), so
it costs nothing while speculation is off. It draws its proposals as sample() draws (its argmax for a greedy
sequence) with the sequence's own sampling parameters and seed: its proposal for generated token number n takes
the uniform the target's draw of n takes, so where the two models' distributions are alike the two draws agree
and verification (`jaxserve.sample.verification`) accepts it.

A speculative head (EAGLE-3: `jaxserve.runner.head_runner`) is proposed for alike, one position behind: at head
position i it reads token i + 1 and the target's hidden states at i, which exist up to the target's last computed
position, so its catch-up ends one position before a draft model's. Its chain's K/V were computed from its own
outputs, not the target's, so a next round recomputes them from the target's: only the catch-up counts as cached.
"""
from __future__ import annotations

from jaxserve.batching.speculation.proposer import Proposals
from jaxserve.batching.step_rows import row_sampling
from jaxserve.runner.batch_builder import Row
from jaxserve.runner.protocol import Runner


class DraftProposer:
    def __init__(self, runner: Runner, max_num_batched_tokens: int, max_num_seqs: int, reads_target: bool = False):
        """reads_target: the runner is a head over the target's hidden states (positions one behind)."""
        self.runner = runner
        self.shift = int(reads_target)
        self.max_tokens = max_num_batched_tokens
        self.max_rows = max_num_seqs

    def available(self, seq) -> None:
        return None  # a draft can always propose

    def propose(self, batch) -> Proposals:
        """Runs the draft for the sequences granted proposals in `batch` (a ScheduledBatch).

        First step(s): each sequence's tokens the draft has not seen, up to its last, which gives the first
        proposal; then one step per further proposal, each taking the token the step before chose straight from
        the device. Everything is dispatched before anything is read back: one wait for all k steps.
        """
        seqs = [s for s in batch.decode if batch.num_draft.get(s, 0) > 0]
        proposals = Proposals({s: [] for s in seqs})
        if not seqs:
            return proposals
        handles = []  # (handle, [(row, seq)]) of the steps whose rows give a proposal
        for rows, sources in self._catch_up_steps(seqs):
            handles.append((self.runner.dispatch(rows), sources))
        for j in range(1, max(batch.num_draft[s] for s in seqs)):
            going = [s for s in seqs if batch.num_draft[s] > j]
            rows = [Row([0], s.num_tokens - 1 - self.shift + j, s.pages, row_sampling(s, j, top_logprobs=False), s.slot,
                        chained=True)
                    for s in going]
            handles.append((self.runner.dispatch(rows), list(enumerate(going))))
        for handle, sources in handles:
            tokens = self.runner.fetch(handle).tokens[:, 0].tolist()
            for i, s in sources:
                proposals.tokens[s].append(tokens[i])
        for s in seqs:
            # The last proposal's K/V is not computed: a next round that accepts it takes it in its catch-up.
            # (A head's chain is recomputed from the target's hidden states.)
            proposals.draft_cached[s] = s.num_tokens - 1 + (0 if self.shift else batch.num_draft[s])
        return proposals

    def _catch_up_steps(self, seqs):
        """Steps of at most max_tokens tokens and max_rows rows covering every sequence's unseen tokens, a long
        one in chunks; the chunk that ends a sequence's tokens samples its first proposal. Yields (rows,
        [(row index, seq)] of the sampling rows)."""
        rows, sources, used = [], [], 0
        for s in seqs:
            start, end = s.num_draft_cached, s.num_tokens - self.shift
            while start < end:
                if used == self.max_tokens or len(rows) == self.max_rows:
                    yield rows, sources
                    rows, sources, used = [], [], 0
                stop = min(end, start + self.max_tokens - used)
                last = stop == end
                if last:
                    sources.append((len(rows), s))
                # A head's position i takes token i + 1 (shift 1).
                rows.append(Row(s.token_ids[start + self.shift:stop + self.shift], start, s.pages,
                                row_sampling(s, top_logprobs=False),
                                s.slot if last else -1, samples=last))
                used += stop - start
                start = stop
        if rows:
            yield rows, sources
