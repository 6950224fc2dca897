"""A speculative head's runner: the target runner's dispatch, fetch and warm-up over the head's own step.

The head keeps its K/V in a one-layer cache of its own, indexed by the target's page ids (as a draft model's is:
pages are allocated, freed and rolled back once, for both), and reads the target runner's captured features, the
array the target's last dispatched step left (JAX orders the read after that step's write, and the target's next
step, which donates the array, after this read). It shares the target's embedding table (an MTP head also its final
norm and LM head: `jaxserve.model.heads.shared_params`): the same device arrays, no copy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache import init_kv_cache
from jaxserve.cache.kv_cache import bf16_pages_as_bits
from jaxserve.model.head_config import HeadConfig
from jaxserve.model.heads import declared_head_params, shared_params
from jaxserve.multihost import LeaderFollower
from jaxserve.pallas_kernels import page_head_dim_multiple
from jaxserve.parallel.mesh import log_placement, param_shardings, place, replicated
from jaxserve.runner.head_steps import head_steps_for
from jaxserve.runner.model_runner import ModelRunner, RunnerConfig
from jaxserve.runner.penalty_slots import PenaltySlots


class HeadRunner(ModelRunner):
    def __init__(self, head: HeadConfig, params: dict, d2t: np.ndarray, rc: RunnerConfig, target: ModelRunner,
                 mesh=None, leader: LeaderFollower | None = None, index: int = 0):
        """params: the head's {"params": ...} tree (numpy; "embed_tokens" taken from the target when absent);
        d2t: int32 [draft_vocab_size], draft id -> target id offsets. rc: the target's runner config (its pages,
        buckets and slots); target: the runner whose steps capture the features this head reads."""
        if target.features is None:
            raise ValueError("the target runner captures no hidden states (RunnerConfig.capture) for the head")
        self.head, self.target = head, target
        self.config = head.layer_config()
        self.page_size, self.buckets, self.num_speculative_tokens = rc.page_size, rc.buckets, 0
        self.mesh, self.leader, self.index = mesh, leader, index
        # The ignore: a head's steps stand where a model's do; the runner calls what both have (step shapes, counts).
        self.steps = head_steps_for(head, rc.dtype, rc.attention_backend, mesh,  # type: ignore[assignment]
                                    rc.kv_cache_dtype)
        own = {k: v for k, v in params["params"].items() if k != "embed_tokens"}
        platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
        tree = {"params": own, "d2t": np.asarray(d2t, np.int32)}
        if mesh is None:
            placed = jax.tree.map(lambda x: jnp.asarray(x, x.dtype), tree)
        else:
            axes = declared_head_params(head).axes
            axes = {"params": {k: v for k, v in axes["params"].items() if k in own}}
            placed = place(tree, {**param_shardings(mesh, {"params": own}, axes), "d2t": replicated(mesh)})
            log_placement("speculative head", placed)
        embed = params["params"].get("embed_tokens")
        embed = target.params["params"]["embed_tokens"] if embed is None else place_like(embed, target)
        # What the head shares with the target (an MTP head: its final norm and LM head too), as the same arrays.
        taken = {name: target.params["params"][name] for name in shared_params(head) if name not in own}
        self.params = {"params": {**placed["params"], **taken, "embed_tokens": embed}, "d2t": placed["d2t"]}

        def new_cache():
            return init_kv_cache(self.config, rc.num_pages, rc.page_size, rc.dtype, rc.kv_cache_dtype,
                                 page_head_dim_multiple(rc.attention_backend),
                                 bf16_pages_as_bits(platform, rc.attention_backend))
        slots = rc.num_slots + 1  # the last one takes padding rows
        if mesh is None:
            self.kv_cache = new_cache()
            self.last_tokens = jnp.zeros(slots, jnp.int32)
            self.last_hidden = jnp.zeros((slots, head.hidden_size), rc.dtype)
        else:
            self.kv_cache = jax.jit(new_cache, out_shardings=self.steps.cache_sharding)()
            self.last_tokens = jax.jit(lambda: jnp.zeros(slots, jnp.int32), out_shardings=replicated(mesh))()
            self.last_hidden = jax.jit(lambda: jnp.zeros((slots, head.hidden_size), rc.dtype),
                                       out_shardings=replicated(mesh))()
        self.features = None  # it reads the target's
        self.penalties = PenaltySlots(slots, self.config.vocab_size, mesh, keep_counts=False)
        self.step_times: dict[tuple[int, int], float] = {}
        self.max_loras, self.max_lora_rank, self.dtype, self.lora = 0, 0, rc.dtype, None
        self._init_transfer(False)

    @property
    def splits_sampling(self) -> bool:
        return False  # its rows are proposals: never under a grammar (constrained rows do not speculate)

    def run(self, batch):
        out, self.kv_cache, self.last_tokens, self.last_hidden = self.steps.step(
            self.params, self.kv_cache, self.last_tokens, self.last_hidden, self.target.features, batch)
        return out


def place_like(table, target: ModelRunner):
    """A head's own embedding table, placed as the target's is (split by vocabulary over its mesh)."""
    like = target.params["params"]["embed_tokens"]
    if target.mesh is None:
        return jnp.asarray(table)
    return place(table, like.sharding)
