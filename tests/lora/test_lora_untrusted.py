"""Adapters from paths a client names (issue 48): judged from adapter_config.json and the safetensors header before
any weight is read (a sparse 2 GiB file is refused having read a few kilobytes), PEFT's rank and alpha patterns
taken as module names only (a key that does not compile, or backtracks without end, is a LoRAError), one message
for a path that holds no adapter whatever the reason (the reason in the log), and one load at a time."""
import json
import math
import pathlib
import shutil
import threading

import jax.numpy as jnp
import pytest

from jaxserve import LoRARequest
from jaxserve.lora.adapter import LoRAError, load_adapter
from jaxserve.lora.patterns import compile_patterns, pattern_value
from jaxserve.lora.safetensors_header import ITEMSIZE
from jaxserve.lora.slot_cache import HostAdapters

from hf_models import save_tiny_lora, save_tiny_model

GIB = 2**30
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama's config (hidden 64, 2 layers) and a good rank-4 adapter on q/v_proj."""
    from jaxserve.weights import load_model
    tmp = tmp_path_factory.mktemp("lora-untrusted")
    save_tiny_model("llama", tmp / "base")
    good = save_tiny_lora(str(tmp / "base"), tmp / "good", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return load_model(str(tmp / "base"), jnp.float32).config, good


def write_safetensors(file, header: dict, size: int | None = None, header_len: int | None = None):
    """A safetensors file of `header`, its data a hole (sparse: no disk, no memory) up to `size` bytes (default: what
    the header declares). header_len: the length field written, if not the header's own."""
    text = json.dumps(header).encode()
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    with open(file, "wb") as f:
        f.write((len(text) if header_len is None else header_len).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + end if size is None else size)


@pytest.fixture
def reads(monkeypatch):
    """The bytes each adapter file gave through Path.open, by name; reading tensors any other way (safetensors'
    loaders) fails the test."""
    got: dict[str, int] = {}
    real_open = pathlib.Path.open

    class Counted:
        def __init__(self, f, name):
            self._f, self._name = f, name

        def read(self, *args):
            data = self._f.read(*args)
            got[self._name] = got.get(self._name, 0) + len(data)
            return data

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def counted_open(self, *args, **kwargs):
        return Counted(real_open(self, *args, **kwargs), self.name)

    def no_tensor_reads(*args, **kwargs):
        raise AssertionError("tensor data read")
    import safetensors
    import safetensors.numpy
    monkeypatch.setattr(pathlib.Path, "open", counted_open)
    monkeypatch.setattr(safetensors, "safe_open", no_tensor_reads)
    monkeypatch.setattr(safetensors.numpy, "load_file", no_tensor_reads)
    return got


def entry(shape, start, dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [start, start + math.prod(shape) * ITEMSIZE[dtype]]}


# Each: a sparse adapter_model.safetensors of 2 GiB or more, and the refusal.
HUGE = {
    "an lm_head key": (lambda f: write_safetensors(f, {
        "base_model.model.lm_head.lora_A.weight": entry((2, (2 * GIB - 4096) // 8), 0)}), "lm_head.*not a LoRA"),
    "rank 2**24": (lambda f: write_safetensors(f, {
        Q_A: entry((2**24, 64), 0),
        Q_A.replace("lora_A", "lora_B"): entry((64, 2**24), 2**24 * 64 * 4)}), "rank 16777216 is above max_lora_rank"),
    "bytes past its tensors": (lambda f: write_safetensors(f, {Q_A: entry((4, 64), 0)}, size=2 * GIB),
                               "2147483648 bytes, but its header declares"),
    "a 2 GiB header": (lambda f: write_safetensors(f, {}, size=2 * GIB, header_len=2 * GIB - 8),
                       "header, above the"),
}


@pytest.mark.parametrize("case", sorted(HUGE))
def test_a_huge_or_ill_keyed_file_is_refused_from_its_header_alone(tiny, tmp_path, reads, case):
    """Before: the whole file was read first (a 2 GiB lm_head file: 400 after 6.4 s, RSS 4.5 -> 7.9 GB)."""
    config, good = tiny
    path = tmp_path / "huge"
    shutil.copytree(good, path)
    write, message = HUGE[case]
    write(path / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match=f"'huge'.*{message}"):
        load_adapter(LoRARequest("huge", 1, str(path)), config, 8)
    assert reads.get("adapter_model.safetensors", 0) < 64 * 1024, reads  # the header at most


def test_only_peft_dtypes_are_taken(tiny, tmp_path):
    config, good = tiny
    path = tmp_path / "ints"
    shutil.copytree(good, path)
    write_safetensors(path / "adapter_model.safetensors", {Q_A: entry((4, 64), 0, "I32")})
    with pytest.raises(LoRAError, match="lora_A.weight: dtype I32; LoRA weights are F32, F16, BF16"):
        load_adapter(LoRARequest("ints", 1, str(path)), config, 8)


def test_a_good_adapter_still_loads(tiny, monkeypatch):
    """The good adapter still loads (its tensors through safe_open, one by one)."""
    import safetensors
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a) or real(*a, **k))
    config, good = tiny
    adapter = load_adapter(LoRARequest("good", 1, str(good)), config, 8)
    assert sorted(adapter.weights) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")]
    assert len(opened) == 1


# ---- rank_pattern / alpha_pattern ----

@pytest.mark.parametrize("key", ["(", "(.|.)*Z", "(a|a)*Z", "q_proj|v_proj", ".*q_proj", r"layers\.\d+\.q_proj",
                                 "[qv]_proj", "x" * 300])
@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_a_pattern_key_that_is_not_a_module_name_is_refused(tiny, tmp_path, field, key):
    """Before: `(` was a 500 (re.error), `(.|.)*Z` ran over 20 s; the others were matched as regexes."""
    config, good = tiny
    path = tmp_path / "pattern"
    shutil.copytree(good, path)
    c = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**c, field: {key: 4}}))
    with pytest.raises(LoRAError, match=f"'pattern'.*{field}: key .*only module names are supported"):
        load_adapter(LoRARequest("pattern", 1, str(path)), config, 8)


def test_too_many_pattern_keys_are_refused():
    with pytest.raises(ValueError, match="3 keys, above the 2"):
        compile_patterns({"a": 1, "b": 2, "c": 3}, 2)


def test_module_name_keys_match_as_peft_matches_them():
    """The keys taken give PEFT's own answer (peft.utils.other.get_pattern_key: the first key that matches)."""
    from peft.utils.other import get_pattern_key
    keys = ["o_proj", "^model.layers.1.self_attn.q_proj", r"layers\.0\.mlp\.gate_proj", "layers.1.mlp.up_proj$",
            "self_attn.k_proj", "model.layers.1", "mlp.down", "0.self_attn.v_proj", "v_proj"]
    patterns = {k: i for i, k in enumerate(keys)}
    compiled = compile_patterns(patterns, len(keys))
    for prefix in ("model.", "model.language_model.", ""):
        for layer in range(3):
            for linear in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
                module = f"{prefix}layers.{layer}.{linear}"
                want = get_pattern_key(keys, module)
                assert pattern_value(compiled, module, None) == patterns.get(want), module


# ---- a path that holds no adapter: one message, the reason in the log ----

def _not_adapters(root):
    """Paths that hold no adapter, each for its own reason."""
    (root / "file").write_text("x")
    (root / "empty").mkdir()
    (root / "config-dir" / "adapter_config.json").mkdir(parents=True)
    for name, text in [("not-json", "{not json"), ("a-list", "[1, 2]")]:
        (root / name).mkdir()
        (root / name / "adapter_config.json").write_text(text)
    (root / "huge-config").mkdir()
    with open(root / "huge-config" / "adapter_config.json", "wb") as f:
        f.truncate(2 * GIB)
    return ["nowhere", "file", "empty", "config-dir", "not-json", "a-list", "huge-config"]


def test_a_path_without_an_adapter_gets_one_message_whatever_the_reason(tiny, tmp_path, caplog):
    """Before: "adapter_config.json: missing" against "unreadable: ..." told a client what lies on the disk."""
    config, _ = tiny
    messages = set()
    for name in _not_adapters(tmp_path):
        path = tmp_path / name
        with pytest.raises(LoRAError) as e:
            load_adapter(LoRARequest("x", 1, str(path)), config, 8)
        messages.add(str(e.value).replace(str(path), "PATH"))
    assert messages == {"LoRA adapter 'x' (PATH): not found, not readable, or not a PEFT LoRA adapter (a directory "
                        "of adapter_config.json and adapter_model.safetensors)"}
    logged = caplog.text
    assert "is not a file" in logged and "not a JSON object" in logged and "above 1048576" in logged, logged


# ---- one load at a time ----

def test_loads_run_one_at_a_time(tiny):
    """A second adapter's load waits for the first's (each holds up to max_lora_rank x the model's shapes), and a
    load of the adapter it waited for is not read twice. Before: loads ran side by side."""
    config, good = tiny
    inside, peak, loaded = [0], [0], []
    first_in, release = threading.Event(), threading.Event()

    def load(request):
        inside[0] += 1
        peak[0] = max(peak[0], inside[0])
        loaded.append(request.lora_int_id)
        if request.lora_int_id == 1:
            first_in.set()
            release.wait()
        adapter = load_adapter(request, config, 8)
        inside[0] -= 1
        return adapter

    host = HostAdapters(load, 4)
    waiting = threading.Event()

    class Spy:  # the lock loads wait on: says when the second one is waiting (or it never waits, before the fix)
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if not self.lock.acquire(blocking=False):
                waiting.set()
                self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()
    if hasattr(host, "_reading"):
        host._reading = Spy(host._reading)
    requests = [LoRARequest("a", 1, str(good)), LoRARequest("b", 2, str(good)), LoRARequest("a", 1, str(good))]
    threads = [threading.Thread(target=host.get, args=(r,)) for r in requests]
    threads[0].start()
    first_in.wait()
    threads[1].start()
    while not (waiting.is_set() or len(loaded) > 1):  # the second waits on the lock, or (before) reads at once
        threading.Event().wait(0.001)
    threads[2].start()
    release.set()
    for t in threads:
        t.join()
    assert peak[0] == 1 and sorted(loaded) == [1, 2], (peak, loaded)
    assert host.ids() == {1, 2}
