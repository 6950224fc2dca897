"""One engine over several processes on localhost (each with its own CPU device, gloo collectives between them), as
over several hosts: the offline API and `jaxserve serve` give one process's outputs, and a process that dies takes
the others down within a bounded time instead of leaving them hanging."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from hf_models import save_tiny_model
from multihost_worker import ENGINE, PARAMS, PROMPTS
from serving import free_port

from jaxserve import LLM, SamplingParams

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "multihost_worker.py"
ENV = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-8-heads")
    save_tiny_model("llama-8-heads", path)
    return str(path)


def start_workers(tp_dir, n, out_dir, *extra):
    coordinator = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen([sys.executable, str(WORKER), tp_dir, coordinator, str(n), str(i), str(n),
                              str(out_dir / f"{i}.json"), *extra], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for i in range(n)]


def one_process_outputs(tp_dir):
    """What multihost_worker.py computes, in this process on one device."""
    llm = LLM(tp_dir, **ENGINE, warmup=False)
    return [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)] for p in PARAMS]


@pytest.mark.parametrize("n", [2, 4])
def test_offline_api_over_processes_gives_one_process_outputs(tp_dir, tmp_path, n):
    """Every process runs the same script; process 0 schedules; all of them return the outputs, greedy and seeded
    sampling alike equal to one process's."""
    workers = start_workers(tp_dir, n, tmp_path)
    logs = [w.communicate(timeout=240)[0] for w in workers]
    assert [w.returncode for w in workers] == [0] * n, logs[0][-3000:]
    want = one_process_outputs(tp_dir)
    for i in range(n):
        assert json.loads((tmp_path / f"{i}.json").read_text()) == want, f"process {i}"


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
        prompt = [5, 6, 7, 8, 9, 10, 11]
        body = {"model": tp_dir, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        out = LLM(tp_dir, max_model_len=96, block_size=4, warmup=False).generate(
            {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
            use_tqdm=False)[0].outputs[0]
        want = [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]
        whole = requests.post(url + "/v1/completions", json=body, timeout=60).json()
        assert whole["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
        streamed = requests.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
        chunks = [json.loads(line[6:])["choices"] for line in streamed.splitlines() if line.startswith("data: {")]
        got = [lp for c in chunks if c for lp in c[0]["logprobs"]["token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)
    finally:
        launcher.send_signal(signal.SIGTERM)  # to process 0, which drains and stops the follower
        log = launcher.communicate(timeout=60)[0]
    assert launcher.returncode == 0, log[-3000:]


@pytest.mark.parametrize("victim, how", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)])
def test_a_lost_process_takes_the_others_down(tp_dir, tmp_path, victim, how):
    """kill -9 of a follower (or of the leader), or a follower that hangs (SIGSTOP), mid-run: the survivor exits
    with an error naming the lost process well within 60 s, never hangs."""
    workers = start_workers(tp_dir, 2, tmp_path, "forever")
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
