"""jaxserve on Ray (jaxserve.scaleout), over a local ray.cluster_utils.Cluster: a head and two fake "TPU hosts" (nodes
of {"TPU": 4}) on this machine. One process per host, placed by a STRICT_SPREAD placement group, forms one group whose
answers are one process's, and one lost actor stops the group; two Ray Serve replicas answer through the official
openai client as a direct server does, and a replica killed mid-load fails only the requests it held.

Ray's footprint is kept small (a CPU or two of logical resources, small object stores, no dashboard, the Serve proxy
on the head only) and it is shut down after the module."""
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import psutil
import pytest
import requests

from jaxserve import SamplingParams

from serving import ServerThread, free_port
from tiny import make_llm

ray = pytest.importorskip("ray")
with warnings.catch_warnings():  # Serve's pydantic models warn of pydantic 3 on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray import serve  # noqa: E402

from jaxserve.scaleout.hosts import launch_hosts  # noqa: E402
from jaxserve.scaleout.replicas import REPLICA_HEADER, build_app  # noqa: E402

OBJECT_STORE = 80 * 2**20  # Ray's smallest is 75 MiB
# Each jaxserve process on one CPU device (the tests' own conftest gives this process eight).
ONE_DEVICE = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
ENGINE_FLAGS = ["--max-model-len", "96", "--block-size", "4", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
                "--dtype", "float32", "--no-warmup"]  # tiny.make_llm's engine (flag pairs, then the switch)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ray_cluster():
    """The nodes' processes (so every actor and its jaxserve process) start with ONE_DEVICE's environment: this
    process's is set for the start only."""
    from ray.cluster_utils import Cluster
    saved = {k: os.environ.get(k) for k in ONE_DEVICE}
    os.environ.update(ONE_DEVICE)
    try:
        cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, object_store_memory=OBJECT_STORE,
                                                                    include_dashboard=False))
        for _ in range(2):
            cluster.add_node(num_cpus=0, resources={"TPU": 4}, object_store_memory=OBJECT_STORE)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    ray.init(address=cluster.address, include_dashboard=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def seeded_prompts(seed: int, count: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(3, 20)))) for _ in range(count)]


@pytest.fixture(scope="module")
def one_process(tiny_tokenized_dir):
    """Greedy completions of the tiny model in one process, by prompt."""
    llm = make_llm(tiny_tokenized_dir)

    def complete(prompt: str) -> str:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    return complete


def client(url: str) -> openai.OpenAI:
    # No retries: a request that failed must show as failed, not be answered by another replica behind our back.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(url: str, prompt: str, stream: bool = False) -> tuple[str, str | None]:
    """(text, the replica that answered) of a greedy completion through the openai client, whole or streamed."""
    raw = client(url).completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=stream,
        extra_body={"ignore_eos": True})
    answer = raw.parse()
    text = "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
    return text, raw.headers.get(REPLICA_HEADER)


def wait_until(condition, what: str, timeout_s: float = 180.0):
    """A bounded wait (never an assertion on how long it took)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.2)


# One process per host

@pytest.fixture(scope="module")
def group(ray_cluster, tiny_tokenized_dir):
    hosts = launch_hosts(2, ["--model", tiny_tokenized_dir, "--served-model-name", "tiny", "--port", str(free_port()),
                             "--tensor-parallel-size", "2", *ENGINE_FLAGS], bundle={"TPU": 4}, env=ONE_DEVICE)
    yield hosts
    hosts.stop()


def test_one_process_per_node_forms_one_group(group, one_process):
    """Each process on a TPU node of its own, holding its bundle; the two serve as one (tensor parallel over both
    processes' devices) and answer as one process does."""
    group.wait_ready(timeout_s=300)
    tpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("TPU")}
    assert len(tpu_nodes) == 2 and {h.node_id for h in group.hosts} == tpu_nodes
    assert [h.resources for h in group.hosts] == [{"TPU": 4.0}] * 2
    seed = int(np.random.SeedSequence().entropy % 2**31)
    for prompt in seeded_prompts(seed, 2):
        assert complete(group.url, prompt)[0] == one_process(prompt), f"seed {seed}, prompt {prompt!r}"
        assert complete(group.url, prompt, stream=True)[0] == one_process(prompt), f"seed {seed}, {prompt!r}"


def test_a_lost_actor_stops_the_group(group):
    """ray.kill of process 1's actor: the group ends, naming process 1, and process 0 serves no more."""
    group.wait_ready(timeout_s=300)
    ray.kill(group.actors[1])
    ended = group.wait(timeout_s=120)
    assert ended is not None and (ended.process_id, ended.returncode) == (1, None), ended
    with pytest.raises(requests.ConnectionError):
        requests.get(group.url + "/health", timeout=10)


def test_the_command_line_places_the_group(ray_cluster, tiny_tokenized_dir, one_process, tmp_path):
    """`jaxserve serve --distributed-executor-backend ray` on the head: it prints process 0's URL, which answers as
    one process does; SIGTERM stops every process and the command ends cleanly."""
    port = free_port()
    log = open(tmp_path / "stderr", "w+")
    cli = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--distributed-executor-backend", "ray", "--num-processes", "2",
         "--ray-bundle", '{"TPU": 4}', "--model", tiny_tokenized_dir, "--served-model-name", "tiny", "--port",
         str(port), "--tensor-parallel-size", "2", *ENGINE_FLAGS],
        env={**os.environ, "RAY_ADDRESS": ray_cluster.address}, stdout=subprocess.PIPE, stderr=log, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in cli.stdout], daemon=True).start()
    try:
        # Ray prints its workers' output on the driver's stdout too ("(pid=...) ...": a prestarted worker's libtpu
        # log, say), before or after jaxserve's own line.
        first = lines.get(timeout=300)
        while not first.startswith("jaxserve: "):
            first = lines.get(timeout=300)
        assert first.startswith("jaxserve: serving at http://") and f":{port} " in first, first
        url = first.split()[3]
        prompt = seeded_prompts(int(np.random.SeedSequence().entropy % 2**31), 1)[0]
        assert complete(url, prompt)[0] == one_process(prompt), prompt
    finally:
        cli.send_signal(signal.SIGTERM)
        cli.wait(120)
    log.seek(0)
    assert cli.returncode == 0, log.read()[-3000:]
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health", timeout=10)


# Replicas behind Ray Serve

@pytest.fixture(scope="module")
def serve_url(ray_cluster, tiny_tokenized_dir):
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    flags = dict(zip((f[2:] for f in ENGINE_FLAGS[:-1:2]), ENGINE_FLAGS[1::2]))
    serve.run(build_app({"model": tiny_tokenized_dir, "served_model_name": "tiny", **flags, "no_warmup": True,
                         "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}, "health_check_period_s": 1}),
              name="jaxserve")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def direct(tiny_tokenized_dir):
    server = ServerThread(make_llm(tiny_tokenized_dir), name="tiny")
    yield server.url
    server.stop()


def test_replicas_answer_as_a_direct_server(serve_url, direct):
    """Whole and streamed, through the openai client; requests go on until both replicas have answered."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    prompts = seeded_prompts(seed, 3)
    want = {(p, s): complete(direct, p, s)[0] for p in prompts for s in (False, True)}
    replicas = set()
    for i in range(64):  # both replicas answer (each request: either, as Serve picks)
        prompt, stream = prompts[i % 3], bool(i % 2)
        text, replica = complete(serve_url, prompt, stream)
        assert text == want[prompt, stream], f"seed {seed}, prompt {prompt!r}, stream {stream}, replica {replica}"
        replicas.add(replica)
        if len(replicas) == 2 and i >= 5:
            break
    assert len(replicas) == 2, replicas


def replica_actors() -> dict:
    """Serve's replica actors by replica id (the last part of their names)."""
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::")]
    return {a["name"].rsplit("#", 1)[1]: ray.get_actor(a["name"], namespace=a["namespace"]) for a in named}


def jaxserve_child(actor) -> psutil.Process:
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))
    return next(p for p in psutil.Process(pid).children() if "jaxserve.cli" in " ".join(p.cmdline()))


def ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ongoing(actor) -> int:
    return ray.get(actor.get_num_ongoing_requests.remote())  # what Serve's router asks a replica


def test_a_killed_replica_fails_only_the_requests_it_held(serve_url, direct):
    """The victim's server is stopped (SIGSTOP) so that what it is handed stays in it; requests go out until it
    holds one and every other has been answered by the other replica. ray.kill then fails the held ones with an
    error (never a hang), requests after it all succeed, and Serve starts a replacement."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    prompts = seeded_prompts(seed, 4)
    want = {p: complete(direct, p)[0] for p in prompts}
    actors = replica_actors()
    victim_id, victim = sorted(actors.items())[0]
    server = jaxserve_child(victim)
    server.send_signal(signal.SIGSTOP)
    pool, sent = ThreadPoolExecutor(16), []
    for i in range(20):
        sent += [(p, pool.submit(complete, serve_url, p, bool(i % 2))) for p in prompts[:2]]
        wait_until(lambda: sum(f.done() for _, f in sent) + ongoing(victim) == len(sent),
                   "every request answered or held by the stopped replica")
        if ongoing(victim):
            break
    held = [(p, f) for p, f in sent if not f.done()]
    assert len(held) == ongoing(victim) >= 1
    for p, f in sent:
        if f.done():
            assert f.result() == (want[p], next(r for r in actors if r != victim_id)), f"seed {seed}, {p!r}"
    ray.kill(victim, no_restart=True)
    for p, f in held:
        error = f.exception(timeout=150)
        assert isinstance(error, openai.APIError) and not isinstance(error, openai.APITimeoutError), error
    wait_until(lambda: ended(server), "the killed replica's server ended with it")
    after = [pool.submit(complete, serve_url, p, stream) for p in prompts for stream in (False, True)]
    for (p, stream), f in zip([(p, s) for p in prompts for s in (False, True)], after):
        text, replica = f.result(timeout=150)
        assert text == want[p] and replica != victim_id, f"seed {seed}, {p!r}, stream {stream}"
    wait_until(lambda: replaced(victim_id), "Serve replaced the killed replica", timeout_s=300)
    pool.shutdown()


def replaced(replica_id: str) -> bool:
    """Two replicas run again, and this one is not among them."""
    states = serve.status().applications["jaxserve"].deployments["jaxserve"].replica_states
    return states.get("RUNNING") == 2 and replica_id not in replica_actors()


def test_a_replica_whose_server_ended_is_replaced(serve_url, direct):
    """One replica's jaxserve server killed (the replica lives on): Serve's health check finds it ended and replaces
    the replica, after which every request succeeds."""
    wait_until(lambda: replaced(""), "two replicas run")
    victim_id, victim = sorted(replica_actors().items())[0]
    jaxserve_child(victim).kill()
    wait_until(lambda: replaced(victim_id), "Serve replaced the replica whose server ended", timeout_s=300)
    seed = int(np.random.SeedSequence().entropy % 2**31)
    for prompt in seeded_prompts(seed, 2):
        for stream in (False, True):
            assert complete(serve_url, prompt, stream)[0] == complete(direct, prompt, stream)[0], f"seed {seed}"
