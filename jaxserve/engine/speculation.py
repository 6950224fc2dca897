"""Speculative decoding's part of building an engine: the draft model or head, checked against the target; what it
adds to each KV page; and each replica's proposer and controller over its runners."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxserve.batching.speculation.controller import SpecController
from jaxserve.batching.speculation.draft import DraftProposer
from jaxserve.batching.speculation.ngram import NgramProposer
from jaxserve.cache import bytes_per_page
from jaxserve.runner.head_runner import HeadRunner
from jaxserve.runner.model_runner import ModelRunner, RunnerConfig
from jaxserve.spec_config import SpeculativeConfig, check_draft
from jaxserve.weights import LoadedModel, load_model, resolve_model_path
from jaxserve.weights.eagle3 import LoadedHead, load_head
from jaxserve.weights.mtp import load_mtp_head
from jaxserve.weights.params import param_bytes


@dataclasses.dataclass
class Speculators:
    """What proposes for the target: a draft model, a head over its hidden states, or neither (n-gram, or none)."""
    draft: LoadedModel | None = None
    head: LoadedHead | None = None

    @property
    def capture(self) -> tuple[int, ...]:
        """The target layers whose inputs its steps must keep for the head."""
        return self.head.config.feature_layers if self.head is not None else ()

    def param_bytes(self) -> int:
        if self.draft is not None:
            return param_bytes(self.draft.params)
        if self.head is not None:  # its embedding is the target's (not counted twice) when it has none of its own
            return param_bytes(self.head.params)
        return 0

    def page_bytes(self, page_size: int, dtype, kv_cache_dtype: str, lanes: int) -> int:
        """What a KV page id costs beyond the target's page: the draft's page, or the head's page and the target's
        captured features of the page's tokens."""
        if self.draft is not None:
            return bytes_per_page(self.draft.config, page_size, dtype, kv_cache_dtype, lanes)
        if self.head is not None:
            return (bytes_per_page(self.head.config.layer_config(), page_size, dtype, kv_cache_dtype, lanes)
                    + page_size * self.head.config.feature_size * jnp.dtype(dtype).itemsize)
        return 0


def load_speculators(spec: SpeculativeConfig | None, target: LoadedModel, dtype, max_model_len: int,
                     tensor_parallel_size: int, target_model: str | None = None) -> Speculators:
    """The draft model or head speculative_config names, checked to propose for the target. target_model: the
    target as the engine was given it (an MTP head is read from its checkpoint, as vLLM reads it)."""
    if spec is None or spec.method == "ngram":
        return Speculators()
    if spec.method == "draft_model":
        draft = load_model(spec.model, dtype)
        check_draft(draft.config, target.config, max_model_len)
        check_same_tokenizer(draft.tokenizer, target.tokenizer)
        return Speculators(draft=draft)
    if spec.method == "mtp":
        head = load_mtp_head(resolve_model_path(spec.model or target_model), target.config, dtype)
    else:
        head = load_head(spec.model, target.config, dtype)
    if head.config.num_kv_heads % tensor_parallel_size or head.config.num_heads % tensor_parallel_size:
        raise ValueError(f"the head's {head.config.num_heads} attention heads and {head.config.num_kv_heads} KV "
                         f"heads do not split over tensor_parallel_size {tensor_parallel_size}")
    return Speculators(head=head)


def check_same_tokenizer(draft, target) -> None:
    probe = "Speculative decoding: 42 tokens, café, 日本語 and\n    def f(x): return x"
    if draft is not None and target is not None and draft.encode(probe) != target.encode(probe):
        raise ValueError("the draft model's tokenizer is not the target's: a draft must share the target's tokenizer")


def proposer_for(spec: SpeculativeConfig, speculators: Speculators, runner: ModelRunner, runner_config: RunnerConfig,
                 add_runner, max_num_batched_tokens: int, max_num_seqs: int):
    """A replica's proposer and controller over its target `runner`. add_runner(make) builds a runner for the
    draft or head, make(index) -> runner, where index is its place in the engine's runners (a multi-process
    leader names runners by it)."""
    proposer: DraftProposer | NgramProposer
    proposer_runner = None
    if speculators.draft is not None:
        # A draft draws its proposals in plain steps, with no adapters (they are the target's).
        draft = speculators.draft
        rc = dataclasses.replace(runner_config, num_speculative_tokens=0, max_loras=0, max_lora_rank=0, capture=())
        proposer_runner = add_runner(lambda index: ModelRunner(draft.config, draft.params, rc, runner.mesh,
                                                               runner.leader, index))
    elif speculators.head is not None:
        head = speculators.head
        proposer_runner = add_runner(lambda index: HeadRunner(head.config, head.params, head.d2t, runner_config,
                                                              runner, runner.mesh, runner.leader, index))
    if proposer_runner is not None:
        proposer = DraftProposer(proposer_runner, max_num_batched_tokens, max_num_seqs,
                                 reads_target=speculators.head is not None)
    else:
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
    # Its step times are the runners', filled in at warm-up.
    controller = SpecController(spec.num_speculative_tokens, runner_config.buckets.num_tokens, runner.step_times,
                                proposer_runner.step_times if proposer_runner else None)
    return proposer, controller
