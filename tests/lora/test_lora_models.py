"""LoRA adapters made with PEFT, served by real engines: the default model against HF transformers + PEFT in
float32 (two adapters of different ranks and targets in one batch beside base rows), bad adapters, and on the tiny
model n-gram speculation and warm-up with adapters swapping through too few slots."""
import threading

import jax
import pytest
import transformers

from jaxserve import LLM, SamplingParams
from jaxserve.lora import buffers
from jaxserve.lora.adapter import LoRAError
from jaxserve.lora.request import LoRARequest
from jaxserve.runner.steps import steps_for

from peft_adapters import hf_greedy, peft_adapter
from tiny import make_llm

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lora_default_llm():
    return LLM(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=256, max_num_seqs=6,
               max_num_batched_tokens=64, warmup=False)


def test_two_adapters_beside_the_base_model_match_hf_peft(lora_default_llm, hf_default_model, tmp_path):
    llm = lora_default_llm
    prompts = [llm.tokenizer.encode(p)[:5] for p in PROMPTS]  # one length: HF runs them as one batch
    adapters = {  # different ranks, targets and scalings (rsLoRA's on one)
        "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "mlp": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj", "down_proj"]),
    }
    want, loras = {None: hf_greedy(hf_default_model, prompts, NEW_TOKENS)}, {}
    for i, (name, config) in enumerate(adapters.items()):
        path = tmp_path / name
        with peft_adapter(hf_default_model, path, seed=i, **config) as model:
            want[name] = hf_greedy(model, prompts, NEW_TOKENS)
        loras[name] = LoRARequest(name, i + 1, str(path))
        assert want[name] != want[None]  # the adapter changes the tokens: the comparison can tell them apart
    # Six rows whose prompts (30 tokens) take one step, then decode together: two step shapes to compile, no more
    # (compiling the default model with LoRA is most of this test's time).
    cases = [(p, name) for name in (None, *adapters) for p in range(len(prompts))]
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[p]} for p, _ in cases], sp, use_tqdm=False,
                        lora_request=[loras.get(name) for _, name in cases])
    assert [o.outputs[0].token_ids for o in outs] == [want[name][p] for p, name in cases]
    alone = llm.generate([{"prompt_token_ids": prompts[p]} for p, _ in cases], sp, use_tqdm=False)  # no adapter
    assert [o.outputs[0].token_ids for o in alone] == [want[None][p] for p, _ in cases]
    llm.core.assert_idle_and_clean()


def test_bad_adapters_are_refused_by_name(lora_default_llm, hf_default_model, tmp_path):
    llm = lora_default_llm
    with peft_adapter(hf_default_model, tmp_path / "wide", seed=0, r=32, lora_alpha=32, target_modules=["q_proj"]):
        pass
    sp = SamplingParams(temperature=0, max_tokens=4)
    for request in (LoRARequest("wide", 11, str(tmp_path / "wide")),  # rank 32 > max_lora_rank 16
                    LoRARequest("missing", 12, str(tmp_path / "nowhere"))):
        with pytest.raises(LoRAError, match=repr(request.lora_name)):
            llm.generate("Hello", sp, use_tqdm=False, lora_request=request)
    assert not {11, 12} & llm.list_loras()
    llm.core.assert_idle_and_clean()


@pytest.fixture(scope="module")
def tiny_adapters(tiny_dir, tmp_path_factory):
    """Three adapters of the tiny Llama: ranks 2, 4 and 8 on different targets."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    root = tmp_path_factory.mktemp("tiny-adapters")
    targets = [["q_proj", "v_proj"], ["o_proj", "gate_proj"], ["k_proj", "up_proj", "down_proj"]]
    requests = []
    for i, (r, modules) in enumerate(zip((2, 4, 8), targets)):
        with peft_adapter(hf, root / f"a{i}", seed=i, b_std=0.2, r=r, lora_alpha=2 * r, target_modules=modules):
            pass
        requests.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return requests


TINY_LORA = dict(enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def tiny_lora_llm(tiny_dir):
    """One slot for three adapters, two of them on the host: slots (and the host) are refilled on the fly."""
    steps_for.cache_clear()  # jitted steps are shared per model config: start from none compiled
    return make_llm(tiny_dir, warmup=True, **TINY_LORA)


def test_ngram_speculation_with_an_adapter_gives_the_plain_tokens(tiny_dir, tiny_adapters, tiny_lora_llm):
    a, b = tiny_adapters[1], tiny_adapters[2]
    prompts = [{"prompt_token_ids": ([5, 9, 14, 2] * 6)[:n]} for n in (9, 17, 23)]
    loras = [a, None, b]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = tiny_lora_llm
    spec = make_llm(tiny_dir, **TINY_LORA, speculative_config=dict(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, adaptive=False))
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False, lora_request=loras)]
    base = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    assert want[0] != base[0] and want[2] != base[2] and want[1] == base[1]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False, lora_request=loras)]
    assert got == want
    assert spec.stats().spec_decode_num_drafts > 0
    spec.core.assert_idle_and_clean()


def test_no_compilation_after_warmup_while_adapters_swap(tiny_adapters, tiny_lora_llm):
    llm = tiny_lora_llm
    loads = llm.scheduler.lora_slots.num_loads
    compiles = []

    def on_compile(event, duration_secs, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 40 + i, 7]} for i in range(4)]
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        for lora in tiny_adapters + [None]:
            llm.generate(prompts[0], sp, use_tqdm=False, lora_request=lora)
        llm.generate(prompts, sp, use_tqdm=False, lora_request=tiny_adapters + [None])
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
    assert compiles == []
    assert llm.scheduler.lora_slots.num_loads - loads >= 6
    llm.core.assert_idle_and_clean()


def test_base_only_steps_run_the_base_program_with_a_plain_engines_tokens(tiny_dir, tiny_adapters, tiny_lora_llm,
                                                                          monkeypatch):
    """With enable_lora and an adapter in its slot, a step whose rows are all on the base model runs the base
    model's program (no LoRA term: the step gets no adapter buffers) and gives an engine without LoRA's tokens and
    logprobs exactly; a step with an adapter row runs the LoRA program."""
    llm = tiny_lora_llm
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [3 + i, 40 + i, 7, 11 + i]} for i in range(3)]
    llm.generate(prompts[0], sp, use_tqdm=False, lora_request=tiny_adapters[0])  # the slot now holds an adapter
    steps = llm.runner.steps
    with_adapters = []

    def spy(*args, **kw):
        with_adapters.append(args[-1] is not None)
        return type(steps).step_with_features(steps, *args, **kw)
    monkeypatch.setattr(steps, "step_with_features", spy)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert with_adapters and not any(with_adapters)
    monkeypatch.undo()
    plain = make_llm(tiny_dir, **{k: v for k, v in TINY_LORA.items() if "lora" not in k})
    assert plain.runner.lora is None
    want = plain.generate(prompts, sp, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    monkeypatch.setattr(steps, "step_with_features", spy)
    with_adapters.clear()
    llm.generate(prompts[1], sp, use_tqdm=False, lora_request=tiny_adapters[0])
    assert all(with_adapters)
    llm.core.assert_idle_and_clean()


def test_the_engine_thread_never_builds_an_adapters_slot_arrays(tiny_dir, tiny_adapters, monkeypatch):
    """An adapter's padded slot arrays are built where it is loaded (here a worker thread adding it, as the server's
    loader pool does), never on the thread that steps, which only writes them into a device slot."""
    llm = make_llm(tiny_dir, **TINY_LORA)
    builders, real = [], buffers.slot_arrays

    def spy(adapter, *args):
        if adapter is not None:
            builders.append(threading.get_ident())
        return real(adapter, *args)
    monkeypatch.setattr(buffers, "slot_arrays", spy)
    worker: list[int] = []

    def add():
        worker.append(threading.get_ident())
        llm.add_lora(tiny_adapters[1])
    thread = threading.Thread(target=add)
    thread.start()
    thread.join()
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [3, 40, 7]}, sp, use_tqdm=False, lora_request=tiny_adapters[1])[0]
    assert len(out.outputs[0].token_ids) == 4 and llm.scheduler.lora_slots.num_loads == 1
    assert builders == worker and threading.get_ident() not in builders
    assert llm.runner.slot_arrays.built_on_demand == 0
    llm.core.assert_idle_and_clean()
