"""The host-side adapter cache and the device slots (jaxserve.lora.slot_cache), against a model of what they must do."""
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.lora.slot_cache import HostAdapters, LoRASlots, content_key


def fake_request(i: int, path: str | None = None):
    return SimpleNamespace(lora_name=f"a{i}", lora_int_id=i, lora_path=path or f"/adapters/{i}")


def fake_load(request):
    if request.lora_path == "bad":
        raise ValueError(f"LoRA adapter {request.lora_name!r}: adapter_config.json: missing")
    # Adapters 1 and 2 have the same weights: one content key.
    shift = min(request.lora_int_id, 1) if request.lora_int_id <= 2 else request.lora_int_id
    return SimpleNamespace(weights={(0, "q_proj"): (np.full((4, 2), shift, np.float32), np.ones((2, 4), np.float32))})


@settings(max_examples=150, deadline=None)
@given(num_slots=st.integers(1, 4), capacity=st.integers(1, 6),
       ops=st.lists(st.tuples(st.sampled_from(["take", "release", "remove"]), st.integers(1, 7)), max_size=60))
def test_slots_and_host_cache_follow_their_model(num_slots, capacity, ops):
    host = HostAdapters(fake_load, capacity)
    device: dict[int, bytes] = {}  # slot -> the key of what was loaded into it (what load_into saw)
    loads = []

    def load_into(slot, adapter):
        assert slots.users(slot) == 0, "a slot in use was refilled"
        device[slot] = content_key(adapter.weights)
        loads.append(slot)

    slots = LoRASlots(num_slots, load_into)
    held: list[tuple[int, bytes]] = []  # (slot, key) of each running sequence's adapter
    host_lru: list[int] = []  # our model of the host cache, least recently used first
    slot_lru = list(range(num_slots))  # our model of the slots, least recently taken first
    for op, i in ops:
        if op == "take":
            lora = host.get(fake_request(i))
            host_lru = [j for j in host_lru if j != i] + [i]
            host_lru = host_lru[-capacity:]
            loaded = next((s for s, k in device.items() if k == lora.key), None)
            in_use = {s for s, _ in held}
            if loaded is None and len(in_use) == num_slots:
                assert not slots.can_take(lora)
                with pytest.raises(RuntimeError):
                    slots.take(lora)
                continue
            assert slots.can_take(lora)
            before = len(loads)
            slot = slots.take(lora)
            if loaded is not None:  # already in a slot: that one, nothing loaded
                assert slot == loaded and len(loads) == before
            else:  # the least recently taken slot nobody uses
                assert slot == next(s for s in slot_lru if s not in in_use) and loads[before:] == [slot]
            assert device[slot] == lora.key
            slot_lru = [s for s in slot_lru if s != slot] + [slot]
            held.append((slot, lora.key))
        elif op == "release" and held:
            slot, key = held.pop(i % len(held))
            slots.release(slot)
        elif op == "remove":
            assert host.remove(i) == (i in host_lru)
            host_lru = [j for j in host_lru if j != i]
        # What running sequences use is still in their slots, and no more slots are in use than there are.
        for slot, key in held:
            assert device[slot] == key
        assert slots.num_in_use() == len({s for s, _ in held}) <= num_slots
        assert sorted(host.ids()) == sorted(host_lru)
        assert [r.lora_int_id for r in host.requests()] == host_lru
    for slot, _ in held:
        slots.release(slot)
    assert slots.num_in_use() == 0


def test_host_cache_errors_change_nothing():
    host = HostAdapters(fake_load, 2)
    a = host.get(fake_request(1))
    assert host.get(fake_request(2)).key == a.key  # the same weights under two ids: one content key
    assert host.get(fake_request(3)).key != a.key
    with pytest.raises(ValueError, match="'a4'"):
        host.get(fake_request(4, "bad"))
    with pytest.raises(ValueError, match="lora_int_id 3 is adapter 'a3'"):
        host.get(fake_request(3, "/elsewhere"))
    assert host.ids() == {2, 3}
    slots = LoRASlots(1, lambda slot, adapter: None)
    with pytest.raises(ValueError, match="no sequence holds"):
        slots.release(0)
    with pytest.raises(ValueError, match="max_loras"):
        LoRASlots(0, lambda slot, adapter: None)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        HostAdapters(fake_load, 0)
