"""The smallest complete use of jaxserve: load a model, build a paged KV cache, run prefill and decode by hand.

    python scripts/drive_steps.py --prompt "The capital of France is" --max-tokens 20
"""
import argparse

import jax.numpy as jnp

from jaxserve.cache import PageAllocator, init_kv_cache, pages_needed
from jaxserve.runner.batch_builder import Row, RowSampling, build_batch
from jaxserve.runner.steps import Steps
from jaxserve.weights import load_model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-tokens", type=int, default=20)
    args = parser.parse_args()

    model = load_model(args.model, jnp.float32)  # config, params pytree, tokenizer
    steps = Steps(model.config, jnp.float32)  # the jitted ragged step, cache donated
    page_size, num_pages = 16, 64
    kv_cache = init_kv_cache(model.config, num_pages, page_size, jnp.float32)  # per layer (K, V) pages
    allocator = PageAllocator(num_pages)
    last_tokens = jnp.zeros(2, jnp.int32)  # where a step keeps each row's sampled token on device (slot -1: padding)

    prompt = model.tokenizer.encode(args.prompt)
    pages = allocator.allocate(pages_needed(len(prompt) + args.max_tokens, page_size))
    greedy = RowSampling(temperature=0.0)
    vocab = model.config.vocab_size

    # Prefill: the whole prompt as one row of a step; the step returns the first sampled token.
    batch = build_batch([Row(prompt, 0, pages, greedy)], page_size, vocab, num_tokens=len(prompt), num_rows=1,
                        pages_per_row=len(pages))
    out, kv_cache, last_tokens = steps.step(model.params, kv_cache, last_tokens, batch)
    tokens = [int(out.tokens[0, 0])]

    # Decode: one token per step at the next position, reading the cache through the page table.
    while len(tokens) < args.max_tokens and tokens[-1] not in model.tokenizer.eos_token_ids:
        row = Row([tokens[-1]], len(prompt) + len(tokens) - 1, pages, greedy)
        batch = build_batch([row], page_size, vocab, num_tokens=1, num_rows=1, pages_per_row=len(pages))
        out, kv_cache, last_tokens = steps.step(model.params, kv_cache, last_tokens, batch)
        tokens.append(int(out.tokens[0, 0]))

    allocator.free(pages)
    print(args.prompt + model.tokenizer.decode(tokens))


if __name__ == "__main__":
    main()
