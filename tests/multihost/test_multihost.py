"""One engine over several processes on localhost (each with its own CPU device, gloo collectives between them), as
over several hosts: the offline API and `jaxserve serve` give one process's outputs, and a process that dies takes
the others down within a bounded time instead of leaving them hanging. The leader's messages are data only and
authenticated, a slow follower holds the leader back rather than losing messages, and a failed or stopped process
ends the whole run cleanly. The leader/follower protocol (phases, their results and errors, nesting, streams,
aborts) is also tested without processes, over a key-value store in memory."""
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import requests

from jaxserve import LLM, SamplingParams, multihost
from jaxserve.batch import is_constant
from jaxserve.multihost import (
    AbortMessage,
    EndMessage,
    ErrorMessage,
    LeaderFollower,
    MessageRefused,
    ShutdownMessage,
    StepChannel,
    StepMessage,
)
from jaxserve.multihost.channel import NONCE_BYTES
from jaxserve.multihost.wire import sign
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.runner.batch_builder import Row, RowSampling, build_batch

from hf_models import save_tiny_model
from locations import ROOT, TESTS
from multihost_worker import ENGINE, PARAMS, PROMPTS
from serving import free_port

ROOT = ROOT
WORKER = TESTS / "multihost_worker.py"
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
       multihost.SECRET_ENV: os.urandom(16).hex()}


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-8-heads")
    save_tiny_model("llama-8-heads", path)
    return str(path)


def start_workers(tp_dir, n, out_dir, *extra, lws=None):
    """n processes of multihost_worker.py, told their place by flags or, given lws (the leader's host), only by
    LeaderWorkerSet's variables."""
    port = free_port()
    return [subprocess.Popen([sys.executable, str(WORKER), tp_dir, f"lws:{port}" if lws else f"127.0.0.1:{port}",
                              str(n), str(i), str(n), str(out_dir / f"{i}.json"), *extra],
                             env=lws_env(n, i, lws) if lws else ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(n)]


def lws_env(n, i, leader="127.0.0.1"):
    """What LeaderWorkerSet sets in pod i of a group of n, its leader on this host (the secret comes from a
    Secret in a real deployment). A name ("localhost", as a pod's DNS name) has the leader bind every interface."""
    return {**ENV, "LWS_LEADER_ADDRESS": leader, "LWS_GROUP_SIZE": str(n), "LWS_WORKER_INDEX": str(i)}


@pytest.fixture(scope="module")
def one_process_outputs(tp_dir):
    """What multihost_worker.py computes, in this process on one device (once: every process count checks it)."""
    llm = LLM(tp_dir, **ENGINE, warmup=False)
    return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] for p in PARAMS]


@pytest.mark.parametrize("n, options, lws", [(2, ["keep=4"], None), (4, [], None), (2, [], "localhost")])
def test_offline_api_over_processes_gives_one_process_outputs(tp_dir, one_process_outputs, tmp_path, n, options,
                                                              lws):
    """Every process runs the same script; process 0 schedules; all of them return the outputs, greedy and seeded
    sampling alike equal to one process's (with 2, through a window of 4 messages: acknowledged every one; and
    with 2 told only `lws:PORT` and LeaderWorkerSet's variables, the leader a host name)."""
    workers = start_workers(tp_dir, n, tmp_path, *options, lws=lws)
    logs = [w.communicate(timeout=240)[0] for w in workers]
    assert [w.returncode for w in workers] == [0] * n, logs[0][-3000:]
    for i in range(n):
        assert json.loads((tmp_path / f"{i}.json").read_text()) == one_process_outputs, f"process {i}"


def wait_ready(url, procs, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a process ended before the server was up"
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not come up")


def test_serving_over_two_processes(tp_dir):
    """scripts/launch_multihost.sh 2 serve: whole and streamed completions as one process computes them, and a
    clean shutdown of every process on SIGTERM."""
    port = free_port()
    launcher = subprocess.Popen(
        ["bash", str(ROOT / "scripts/launch_multihost.sh"), "2", "serve", "--model", tp_dir, "--port", str(port),
         "--tensor-parallel-size", "2", "--max-model-len", "96", "--block-size", "4", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16"], env={**ENV, "XLA_FLAGS": ""}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, [launcher])
        assert_one_process_completions(url, tp_dir, stream=True)
    finally:
        launcher.send_signal(signal.SIGTERM)  # to process 0, which drains and stops the follower
        log = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 0, log[-3000:]


def assert_one_process_completions(url, tp_dir, stream):
    """A greedy completion (and, if stream, the same streamed) from the server at url has one process's logprobs."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    body = {"model": tp_dir, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    out = LLM(tp_dir, dtype="float32", max_model_len=96, block_size=4, warmup=False).generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
        use_tqdm=False)[0].outputs[0]
    want = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]
    whole = requests.post(url + "/v1/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
    if stream:
        streamed = requests.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
        chunks = [json.loads(line[6:])["choices"] for line in streamed.splitlines() if line.startswith("data: {")]
        got = [lp for c in chunks if c for lp in c[0]["logprobs"]["token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("victim, how, lws", [(1, signal.SIGKILL, None), (0, signal.SIGKILL, None),
                                              (1, signal.SIGSTOP, None), (1, signal.SIGKILL, "127.0.0.1")])
def test_a_lost_process_takes_the_others_down(tp_dir, tmp_path, victim, how, lws):
    """kill -9 of a follower (or of the leader), or a follower that hangs (SIGSTOP), mid-run: the survivor exits
    with an error naming the lost process well within 60 s, never hangs (a LeaderWorkerSet group's leader too, which
    its RecreateGroupOnPodRestart policy then restarts with the group)."""
    workers = start_workers(tp_dir, 2, tmp_path, "forever", lws=lws)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "0.json.ready").exists():  # then generating: every step waits on both processes
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "never got going"
            time.sleep(0.2)
        time.sleep(1)
        workers[victim].send_signal(how)
        killed = time.monotonic()
        survivor = workers[1 - victim]
        log = survivor.communicate(timeout=60)[0]
        assert survivor.returncode != 0
        assert time.monotonic() - killed < 60
        assert "unhealthy" in log or "Socket closed" in log or "heartbeat" in log.lower(), log[-3000:]
    finally:
        for w in workers:
            w.kill()


# ---- the leader's messages (a coordination service in this process: the store the processes' channels share) ----

@pytest.fixture(scope="module")
def kv_client():
    from jax._src.lib import _jax  # what jax.distributed starts, without touching this process's JAX backends
    address = f"127.0.0.1:{free_port()}"
    service = _jax.get_distributed_runtime_service(address, 1, heartbeat_timeout=10, shutdown_timeout=5)
    client = _jax.get_distributed_runtime_client(address, 0, init_timeout=10, heartbeat_timeout=10,
                                                 shutdown_timeout=5)
    client.connect()
    yield client
    client.shutdown()
    service.shutdown()


_names = itertools.count()
SECRET = b"0123456789abcdef"


def leader_and_follower(client, follower_secret=SECRET):
    name = f"test{next(_names)}"  # each test its own keys
    return StepChannel(SECRET, name, client, 0, 2), StepChannel(follower_secret, name, client, 1, 2), name


def within(seconds, fn):
    """fn()'s result or error, failing (rather than hanging) if it takes longer than `seconds`."""
    box = []
    thread = threading.Thread(target=lambda: box.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"still waiting after {seconds} s"
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _outcome(fn):
    try:
        return True, fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        return False, e


def test_every_message_kind_round_trips(kv_client):
    """Steps (their page table sent only as wide as used, restored to full width), results as plain data rebuilt
    into their dataclasses, errors as a known type or a RuntimeError naming the type, abort and shutdown."""
    leader, follower, _ = leader_and_follower(kv_client)
    rows = [Row([5, 6, 7], 8, [3, 4, 9], RowSampling(temperature=0.5, seed=7, banned=(1, 2)), slot=1),
            Row([0], 20, [1, 2, 5, 6, 10, 11], slot=2, chained=True)]
    batch = build_batch(rows, 4, 320, 16, 4, 24)
    completion = CompletionOutput(0, "héllo", [3, 4], -1.25, [{3: Logprob(-0.5, 1, "h"), 9: Logprob(-2.0, 2, None)},
                                                             {4: Logprob(float("-inf"), 7)}], "length", 4)
    output = RequestOutput("r1", None, [1, 2], [completion, CompletionOutput(1, "", [], None, None)], True,
                           RequestMetrics(1.5, 2.0, None, 3.25, 1),
                           prompt_logprobs=[None, {2: Logprob(-0.75, 3, "b"), 5: Logprob(-0.125, 1, "x")}])
    messages = [StepMessage(1, batch), EndMessage([output]), EndMessage(["a", "b"]), EndMessage(None),
                EndMessage([]), EndMessage({"tok_s": 1.5, "runs": [1, 2]}), ErrorMessage(ValueError("bad prompt")),
                AbortMessage("why"), ShutdownMessage()]
    for message in messages:
        leader.send(message)
    for message in messages:
        got = follower.receive()
        assert type(got) is type(message)
        if isinstance(message, StepMessage):
            assert got.runner_index == 1 and type(got.batch) is type(batch)
            assert_same_batch(got.batch, batch)
        elif isinstance(message, ErrorMessage):
            assert type(got.error) is ValueError and str(got.error) == "bad prompt"
        else:
            assert got == message
    leader.send(ErrorMessage(OSError("disk")))  # not a type followers raise: a RuntimeError that names it
    got = follower.receive().error
    assert type(got) is RuntimeError and str(got) == "OSError: disk"
    with pytest.raises(TypeError, match="cannot receive"):  # only plain data: refused on the leader, not garbled
        leader.send(EndMessage((1, 2)))
    with pytest.raises(TypeError, match="not a message"):
        leader.send({"kind": "shutdown"})


def assert_same_batch(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert [(a.dtype, a.shape) for a in got] == [(b.dtype, b.shape) for b in want]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_the_page_table_goes_only_as_wide_as_used(kv_client):
    """A step's page table and past tokens are sent up to their last used column, and an array no row uses (a
    `constant`) as its recipe, so a message does not grow with max_model_len."""
    leader, follower, _ = leader_and_follower(kv_client)
    for sampling in (RowSampling(), RowSampling(repetition_penalty=1.2, past_tokens=np.arange(8, dtype=np.int32),
                                                logit_bias=(np.array([3]), np.array([1.0]))))[::-1]:
        rows = [Row([1], 8, [3, 4, 9], sampling)]
        narrow, wide = (build_batch(rows, 4, 320, 1, 1, width) for width in (24, 2400))
        before = leader.bytes_sent
        leader.send(StepMessage(0, narrow))
        small = leader.bytes_sent - before
        leader.send(StepMessage(0, wide))
        # The widths the follower restores: two more digits each (the page table's and the past tokens', sent
        # trimmed or as a constant's shape).
        assert leader.bytes_sent - before - small == small + 4
        for want in (narrow, wide):
            got = follower.receive().batch
            assert_same_batch(got, want)
            assert is_constant(got.sampling.past_tokens) == is_constant(want.sampling.past_tokens)


def test_a_forged_pickle_is_refused_unread(kv_client, tmp_path):
    """Whoever reaches the coordinator's port can write a message key; what it writes is never unpickled."""
    marker = tmp_path / "pwned"
    plant = pickle.dumps(("step", 0, type("Plant", (), {"__reduce__": lambda self: (open, (str(marker), "w"))})()))
    _, follower, name = leader_and_follower(kv_client)
    kv_client.key_value_set_bytes(f"{name}/run", plant)  # in place of the run id the leader publishes
    with pytest.raises(MessageRefused, match="refused the run id"):
        follower.receive()
    leader, follower, name = leader_and_follower(kv_client)
    leader.send(ShutdownMessage())
    kv_client.key_value_set_bytes(f"{name}/message/0", plant, allow_overwrite=True)
    with pytest.raises(MessageRefused, match="authentication"):
        follower.receive()
    assert not marker.exists()


def test_a_wrong_altered_or_replayed_message_is_refused(kv_client):
    leader, follower, name = leader_and_follower(kv_client)
    for text in ("hello", "again"):
        leader.send(EndMessage([text]))
    stranger = StepChannel(b"another secret, 16+ bytes", name, kv_client, 1, 2)
    stranger._nonce = follower._nonce  # the follower's place in the run, but not its secret
    with pytest.raises(MessageRefused, match="refused the run id: not signed with this secret"):
        stranger.receive()
    data = kv_client.key_value_try_get_bytes(f"{name}/message/0")
    kv_client.key_value_set_bytes(f"{name}/message/0", data[:-3] + b"bye", allow_overwrite=True)  # MAC kept
    with pytest.raises(MessageRefused, match="authentication"):
        follower.receive()
    kv_client.key_value_set_bytes(f"{name}/message/0", data, allow_overwrite=True)
    assert follower.receive().result == ["hello"]
    kv_client.key_value_set_bytes(f"{name}/message/1", data, allow_overwrite=True)  # message 0 again, in 1's place
    with pytest.raises(MessageRefused, match="replayed or reordered"):
        follower.receive()


def earlier_run():
    """The keys a run of two processes left in its coordination service (what someone recording them holds): its
    run id, two messages, a follower's stop request. Every run names its keys alike ("jaxserve")."""
    store = MemoryStore()
    leader, follower = StepChannel(SECRET, "jaxserve", store, 0, 2), StepChannel(SECRET, "jaxserve", store, 1, 2)
    for text in ("run A", "run A again"):
        leader.send(EndMessage([text]))
    follower.receive()
    follower.request_stop()
    return store.data


@pytest.mark.parametrize("replayed", ["run id and messages", "messages"])
def test_a_message_recorded_in_an_earlier_run_is_refused(replayed):
    """Same secret, same keys, same index: a message from an earlier run does not decode in this one (the issue's
    replay), whether the run id is replayed with it (before this run's leader publishes its own) or not."""
    recorded = earlier_run()
    store = MemoryStore()
    leader, follower = StepChannel(SECRET, "jaxserve", store, 0, 2), StepChannel(SECRET, "jaxserve", store, 1, 2)
    if replayed == "messages":
        leader.send(EndMessage(["run B"]))
    for key in ("jaxserve/run", "jaxserve/message/0")[replayed == "messages":]:
        store.key_value_set_bytes(key, recorded[key], allow_overwrite=True)
    with pytest.raises(MessageRefused, match="not this run" if replayed != "messages" else "authentication"):
        follower.receive()
    fresh = MemoryStore()  # the same run unrecorded: the messages go through
    leader, follower = StepChannel(SECRET, "jaxserve", fresh, 0, 2), StepChannel(SECRET, "jaxserve", fresh, 1, 2)
    leader.send(EndMessage(["run B"]))
    assert follower.receive().result == ["run B"]


def test_stop_ack_and_oldest_keys_are_authenticated(kv_client, monkeypatch):
    """Only a process of this run can ask the leader to stop, acknowledge messages (so that the leader deletes
    them) or tell a follower which messages are gone: a forged or recorded value is ignored (stop, ack) or refused
    (oldest), never acted on."""
    recorded = earlier_run()
    monkeypatch.setattr(multihost.channel, "KEEP_MESSAGES", 4)  # an acknowledgement every message
    monkeypatch.setattr(multihost.channel, "POLL_MS", 50)
    leader, follower, name = leader_and_follower(kv_client)
    leader.send(EndMessage([0]))
    for forged in (b"1", recorded["jaxserve/stop"]):  # a bare process index; a signed request of an earlier run
        assert not leader._authentic_stop(forged)
    stopped = threading.Event()
    leader.watch_stop_requests(stopped.set)
    kv_client.key_value_set_bytes(f"{name}/stop", recorded["jaxserve/stop"])
    within(30, lambda: wait_until(lambda: _absent(kv_client, f"{name}/stop")))  # read, refused and removed
    assert not stopped.is_set()
    follower.request_stop()
    within(30, stopped.wait)
    leader.close()
    # Acknowledgements: the leader keeps 4 messages; the 5th waits for the follower to have read the first.
    for i in range(1, 4):
        leader.send(EndMessage([i]))
    kv_client.key_value_set_bytes(f"{name}/ack/1/1", b"1")  # forged: deleting message 0 unread would lose it
    sending = threading.Thread(target=leader.send, args=(EndMessage([4]),), daemon=True)
    sending.start()
    within(30, lambda: wait_until(lambda: _absent(kv_client, f"{name}/ack/1/1")))  # read, refused and removed
    assert sending.is_alive() and _present(kv_client, f"{name}/message/0")
    assert follower.receive().result == [0]  # its acknowledgement lets the leader go on
    sending.join(30)
    assert not sending.is_alive() and _absent(kv_client, f"{name}/message/0")
    assert [follower.receive().result for _ in range(4)] == [[1], [2], [3], [4]]
    kv_client.key_value_set_bytes(f"{name}/oldest", b"9", allow_overwrite=True)  # forged: "messages 5-8 are gone"
    with pytest.raises(MessageRefused, match="the oldest message's number failed authentication"):
        within(30, follower.receive)  # waiting for message 5, it looks at the oldest kept


def wait_until(condition):
    while not condition():
        time.sleep(0.01)


def _present(client, key):
    try:
        client.key_value_try_get_bytes(key)
        return True
    except Exception as e:  # noqa: BLE001 - jaxlib's error type is not public
        assert "NOT_FOUND" in str(e)
        return False


def _absent(client, key):
    return not _present(client, key)


def test_a_run_needs_a_secret_and_binds_one_interface(monkeypatch):
    """Every multi-process run, on one host too (a loopback port is open to every user of the host), refuses to
    start without a shared secret of 16 bytes or more; the service binds the coordinator's address."""
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.delenv(multihost.SECRET_ENV, raising=False)
    for address, bind in (("127.0.0.1:1234", None), ("10.1.2.3:1234", None), ("127.0.0.1:1234", "0.0.0.0:1234"),
                          ("auto", None)):
        multihost.initialize(address, None if address == "auto" else 2, None if address == "auto" else 1, bind)
        for secret in (None, "", "15 bytes secret"):
            if secret is not None:
                monkeypatch.setenv(multihost.SECRET_ENV, secret)
            with pytest.raises(ValueError, match="shared secret of at least 16 bytes"):
                multihost.shared_secret()
        monkeypatch.delenv(multihost.SECRET_ENV)
    assert calls[0]["coordinator_bind_address"] == "127.0.0.1:1234"
    assert calls[1]["coordinator_bind_address"] == "10.1.2.3:1234"
    monkeypatch.setenv(multihost.SECRET_ENV, "a secret of 16 bytes or more")
    assert multihost.shared_secret() == b"a secret of 16 bytes or more"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        StepChannel(b"", "x", MemoryStore(), 0, 2)


def test_a_slow_follower_holds_the_leader_back(kv_client, monkeypatch):
    """A burst of more messages than the leader keeps (a draft model catching up a long context) waits for the
    follower's acknowledgements instead of deleting what it has not read."""
    monkeypatch.setattr(multihost.channel, "KEEP_MESSAGES", 4)
    leader, follower, _ = leader_and_follower(kv_client)
    sent = threading.Thread(target=lambda: [leader.send(EndMessage([str(i)])) for i in range(20)], daemon=True)
    sent.start()
    got, ahead = [], []
    for _ in range(20):
        time.sleep(0.02)
        ahead.append(leader._count - follower._count)
        got.append(within(10, follower.receive).result[0])
    sent.join(10)
    assert got == [str(i) for i in range(20)] and max(ahead) <= 4


def test_a_follower_that_lost_a_message_stops(kv_client):
    """A message gone before the follower read it (the leader publishes the oldest it keeps) is an error, not an
    endless wait for it."""
    leader, follower, name = leader_and_follower(kv_client)
    leader.send(EndMessage(None))
    leader.send(EndMessage(None))
    kv_client.key_value_delete(f"{name}/message/0")
    kv_client.key_value_set_bytes(f"{name}/oldest", sign(SECRET, b"1", b"oldest", leader._run))
    with pytest.raises(RuntimeError, match="lost the leader's message 0"):
        within(10, follower.receive)


# ---- the leader/follower protocol (its channels over a key-value store in memory: no processes) ----

class MemoryStore:
    """What StepChannel uses of the coordination service's client, in memory. The protocol tests run the leader's
    part to its end before the follower's, so a follower reading a message not yet sent is an error, not a wait."""

    def __init__(self):
        self.data = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.data, key
        self.data[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.data:
            raise AssertionError(f"nothing at {key}: the leader sent no such message")
        return self.data[key]

    def key_value_try_get_bytes(self, key):
        if key not in self.data:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.data[key]

    def key_value_delete(self, key):
        self.data.pop(key, None)


class Exited(BaseException):
    """What multihost.process.exit_now raises in these tests instead of ending the process."""


@pytest.fixture
def exits(monkeypatch):
    """multihost.process.exit_now's calls (each raises Exited)."""
    calls = []

    def exit_now(code=1, message=None):
        calls.append((code, message))
        raise Exited(message)
    monkeypatch.setattr(multihost.process, "exit_now", exit_now)
    return calls


def leader_and_follower_protocols():
    """(leader, follower, the steps the follower ran as (runner index, batch))."""
    store, ran = MemoryStore(), []
    leader = LeaderFollower(StepChannel(SECRET, "p", store, 0, 2), True)
    follower = LeaderFollower(StepChannel(SECRET, "p", store, 1, 2), False,
                              run_step=lambda index, batch: ran.append((index, batch)))
    return leader, follower, ran


def a_batch(first_token):
    return build_batch([Row([first_token, 6, 7], 8, [3, 4, 9], slot=1)], 4, 320, 16, 4, 24)


def published(protocol):
    """The messages the leader has sent so far, as a follower reads them."""
    channel = protocol.channel
    reader = StepChannel(SECRET, "p", channel._client, 1, 2)
    reader._nonce = channel._run[NONCE_BYTES:2 * NONCE_BYTES]  # the follower's place in the leader's run
    return [reader.receive() for _ in range(channel._count)]


def test_the_leader_publishes_its_steps_and_the_phase_result():
    """Each step before it runs (with its runner's index), then the phase's result; the follower runs the steps in
    order, without calling fn, and returns the leader's result."""
    leader, follower, ran = leader_and_follower_protocols()
    batches, local = [a_batch(1), a_batch(2), a_batch(3)], []

    def phase():
        for i, batch in enumerate(batches):
            assert leader.lead_step(i % 2, batch, lambda b: local.append(b) or len(local)) == len(local)
        return ["done"]
    assert leader.run(phase) == ["done"]
    assert local == batches
    messages = published(leader)
    assert [type(m) for m in messages] == [StepMessage] * 3 + [EndMessage]
    assert [m.runner_index for m in messages[:3]] == [0, 1, 0] and messages[3].result == ["done"]
    assert follower.run(lambda: pytest.fail("a follower does not run the phase itself")) == ["done"]
    assert [index for index, _ in ran] == [0, 1, 0]
    for (_, got), want in zip(ran, batches):
        assert_same_batch(got, want)
    assert (leader.is_leader, leader.multi_process, leader.is_follower) == (True, True, False)
    assert (follower.is_leader, follower.multi_process, follower.is_follower) == (False, True, True)


def test_an_error_on_the_leader_is_raised_on_the_follower():
    """A failed phase fails on every process, after the steps it took (a type followers do not know: a
    RuntimeError that names it)."""
    leader, follower, ran = leader_and_follower_protocols()

    def failing(error):
        def phase():
            leader.publish_step(0, a_batch(1))
            raise error
        return phase
    with pytest.raises(ValueError, match="bad prompt"):
        leader.run(failing(ValueError("bad prompt")))
    with pytest.raises(OSError):
        leader.run(failing(OSError("disk")))
    assert leader.run(lambda: None) is None  # the leader goes on with its next phase, as do the followers
    with pytest.raises(ValueError, match="bad prompt"):
        follower.run(lambda: None)
    with pytest.raises(RuntimeError, match="^OSError: disk$"):
        follower.run(lambda: None)
    assert follower.run(lambda: 1) is None
    assert len(ran) == 2


def test_a_nested_run_is_part_of_the_outer_phase():
    """A generate inside another phase's fn (a benchmark's timed run) publishes no result of its own."""
    leader, follower, ran = leader_and_follower_protocols()

    def inner():
        leader.publish_step(0, a_batch(1))
        return 1
    assert leader.run(lambda: leader.run(inner) + leader.run(inner)) == 2
    assert [type(m) for m in published(leader)] == [StepMessage, StepMessage, EndMessage]
    assert follower.run(lambda: None) == 2 and len(ran) == 2
    with pytest.raises(KeyError):  # the phase is over even when it failed: the next one publishes its own result
        leader.run(lambda: leader.run(lambda: {}["missing"]))
    assert leader.run(lambda: 5) == 5 and [type(m) for m in published(leader)][3:] == [ErrorMessage, EndMessage]


def test_a_failed_published_step_aborts_every_process(exits):
    """The leader's step fails once published: it tells the followers and ends; a follower runs the step, then
    ends too, saying why."""
    leader, follower, ran = leader_and_follower_protocols()

    def broken(batch):
        raise RuntimeError("injected device failure")
    with pytest.raises(Exited):
        leader.lead_step(1, a_batch(1), broken)
    assert exits == [(1, "jaxserve: error: process 0 failed a step it had sent to the other processes "
                          "(RuntimeError: injected device failure); every process ends, as they are no longer in "
                          "step")]
    assert [type(m) for m in published(leader)] == [StepMessage, AbortMessage]
    with pytest.raises(Exited):
        follower.run(lambda: None)
    assert len(ran) == 1
    assert exits[1] == (1, "jaxserve: error: process 0 failed a step it had sent to the other processes "
                           "(RuntimeError: injected device failure)")


def test_follow_runs_every_phase_until_shutdown(exits):
    """A server's follower: every phase's steps, their results and errors ignored, until the leader's shutdown."""
    leader, follower, ran = leader_and_follower_protocols()
    leader.run(lambda: leader.publish_step(0, a_batch(1)))

    def failing():
        leader.publish_step(1, a_batch(2))
        raise ValueError("bad prompt")
    with pytest.raises(ValueError):
        leader.run(failing)
    assert list(leader.stream(lambda: iter(["a", "b"]))) == ["a", "b"]
    leader.shutdown()
    assert follower.follow() is None
    assert [index for index, _ in ran] == [0, 1]
    with pytest.raises(RuntimeError, match="for processes other than 0"):
        leader.follow()
    assert exits == []


def test_a_stream_publishes_what_it_yielded_however_it_ends():
    """Finished, closed early by its consumer, or failed: the follower's stream yields the leader's pieces."""
    leader, follower, _ = leader_and_follower_protocols()
    assert list(leader.stream(lambda: iter(["a", "b"]))) == ["a", "b"]
    stream = leader.stream(lambda: iter(["c", "d", "e"]))
    assert next(stream) == "c"
    stream.close()

    def failing():
        yield "f"
        raise ValueError("mid-stream")
    with pytest.raises(ValueError):
        list(leader.stream(failing))
    leader.end_stream(["g"])
    assert [m.result for m in published(leader)] == [["a", "b"], ["c"], ["f"], ["g"]]
    for want in (["a", "b"], ["c"], ["f"], ["g"]):
        assert list(follower.stream(lambda: pytest.fail("a follower does not stream itself"))) == want


def test_one_process_publishes_nothing():
    """No channel: run(fn) is fn(), a step is just run, a stream just yields, and shutdown does nothing."""
    alone = LeaderFollower(None, True)
    assert (alone.is_leader, alone.multi_process, alone.is_follower) == (True, False, False)
    assert alone.run(lambda: alone.run(lambda: 3)) == 3
    with pytest.raises(ValueError):
        alone.run(lambda: int("x"))
    assert alone.lead_step(0, "batch", lambda b: b * 2) == "batchbatch"
    alone.publish_step(0, "batch")
    assert list(alone.stream(lambda: iter(["a"]))) == ["a"]
    alone.end_stream(["a"])
    alone.shutdown()
    with pytest.raises(RuntimeError):
        alone.follow()
    with pytest.raises(RuntimeError):
        alone.abort("why")


def test_a_follower_publishes_no_step():
    _, follower, _ = leader_and_follower_protocols()
    with pytest.raises(RuntimeError, match="publishes none"):
        follower.publish_step(0, a_batch(1))
    with pytest.raises(RuntimeError, match="leader of a multi-process run"):
        follower.abort("why")
    follower.shutdown()  # nothing: only the leader ends the run
    assert list(follower.channel._client.data) == ["p/hello/1"]  # its part of the run id, no message


# ---- failures and signals over real processes ----

def test_a_failed_published_step_ends_every_process(tp_dir, tmp_path):
    """Process 0's step fails after it was published (the follower runs it): rather than go on out of step (a
    server would carry on), every process ends, process 0 saying why."""
    workers = start_workers(tp_dir, 2, tmp_path, "fail-step", "no-warmup")
    logs = [w.communicate(timeout=120)[0] for w in workers]  # ended, not hanging
    assert all(w.returncode != 0 for w in workers), logs[0][-3000:]
    assert "failed a step it had sent" in logs[0] and "no longer in step" in logs[0], logs[0][-3000:]
    assert "generate failed" not in logs[0]  # it did not carry on
    assert not (tmp_path / "0.json").exists()


def serve_processes(tp_dir, port, grace, lws=False):
    """`jaxserve serve` as two processes, each told its place by flags or (lws) the same command in each, its place
    from LeaderWorkerSet's variables alone."""
    coordinator = free_port()
    places = [["--coordinator-address", f"lws:{coordinator}"]] * 2 if lws else [
        ["--coordinator-address", f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id", str(i)]
        for i in range(2)]
    return [subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", tp_dir, "--port", str(port),
         "--tensor-parallel-size", "2", "--max-model-len", "96", "--block-size", "4", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16", "--no-warmup", "--shutdown-grace-period", str(grace), *place],
        env=lws_env(2, i) if lws else ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i, place in enumerate(places)]


def test_sigterm_to_a_follower_ends_the_run_cleanly(tp_dir):
    """Orchestrators send SIGTERM to every process; one to a follower (which JAX's preemption notifier would
    swallow) stops the run as one to process 0 does: process 0 drains, and every process exits 0 within the grace
    period."""
    port, grace = free_port(), 5
    procs = serve_processes(tp_dir, port, grace)
    try:
        wait_ready(f"http://127.0.0.1:{port}", procs)
        procs[1].send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=grace + 40)[0] for p in procs]  # within the grace period, with slack for CI
        assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    finally:
        for p in procs:
            p.kill()


def test_serve_in_a_leader_worker_set_group(tp_dir):
    """The command a LeaderWorkerSet manifest gives every pod, `--coordinator-address lws:PORT`: the pod with
    LWS_WORKER_INDEX 0 alone listens for HTTP, its completions are one process's, and SIGTERM (what Kubernetes sends
    every pod) ends the group cleanly."""
    port = free_port()
    procs = serve_processes(tp_dir, port, 5, lws=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, procs)
        assert [listens(p.pid, port) for p in procs] == [True, False]
        assert_one_process_completions(url, tp_dir, stream=False)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        logs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    finally:
        for p in procs:
            p.kill()


def listens(pid, port):
    """Whether process pid holds a TCP socket listening on port (Linux's /proc)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                sockets.add(f"socket:[{fields[9]}]")
    return any(link in sockets for link in map(read_link, Path(f"/proc/{pid}/fd").iterdir()))


def read_link(path):
    try:
        return os.readlink(path)
    except OSError:  # closed since listed
        return None


def test_a_sigterm_while_the_model_loads_is_held_for_the_run():
    """Between jax.distributed.initialize (whose preemption notifier would swallow SIGTERM) and the run's own
    handler, a SIGTERM is remembered, once: the CLI then stops the run it would have missed."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        multihost.process.hold_sigterm()
        assert not multihost.take_held_sigterm()
        os.kill(os.getpid(), signal.SIGTERM)
        assert multihost.take_held_sigterm()
        assert not multihost.take_held_sigterm()  # taken
    finally:
        signal.signal(signal.SIGTERM, before)


def test_generate_over_processes_prints_only_the_answer(tp_dir, tmp_path):
    """Over several processes gloo writes to file descriptor 1 from C++; stdout must still carry the answer alone
    (what one process prints), the library's lines going to stderr."""
    model = tmp_path / "with-tokenizer"
    model.mkdir()
    for f in Path(tp_dir).iterdir():
        (model / f.name).symlink_to(f)
    save_byte_tokenizer(model)
    launched = subprocess.run(["bash", str(ROOT / "scripts/launch_multihost.sh"), "2", "generate", "--model",
                               str(model), "--prompt", "Hello there", "--max-tokens", "6", "--max-model-len", "96",
                               "--block-size", "4", "--tensor-parallel-size", "2"], env={**ENV, "XLA_FLAGS": ""},
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert launched.returncode == 0, launched.stderr[-3000:]
    answer = LLM(str(model), dtype="float32", max_model_len=96, block_size=4, max_num_seqs=1, warmup=False).stream(
        "Hello there", SamplingParams(temperature=0, max_tokens=6))  # what `jaxserve generate` prints alone
    assert launched.stdout == "".join(answer) + "\n"
    assert "Gloo" in launched.stderr  # the line this is about: on stderr, not gone


def save_byte_tokenizer(path):
    """A byte-level tokenizer.json for the tiny model's 320 ids: the 256 bytes, then 64 two-byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({alphabet[i] + alphabet[i + 1]: 256 + i for i in range(64)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
