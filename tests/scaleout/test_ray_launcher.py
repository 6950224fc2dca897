"""The Ray launchers' pieces that need no cluster: flags and their errors, the command line's one-line error without
Ray, a stream relayed from a server that goes away, and that nothing imports Ray until it is used."""
import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from jaxserve.cli import main
from jaxserve.scaleout.hosts import actor_options, http_address
from jaxserve.scaleout.launch import process_args, ray_bundle
from jaxserve.scaleout.replicas import JaxserveReplica, serve_flags

from locations import ROOT


def test_build_app_keys_become_serve_flags():
    flags = serve_flags({"model": "/m", "max_model_len": 96, "max-num-seqs": "4", "enable_lora": True,
                         "no_warmup": "true", "enforce_eager": False, "lora_modules": ["a=/a", "b=/b"]})
    assert flags == ["--model", "/m", "--max-model-len", "96", "--max-num-seqs", "4", "--enable-lora",
                     "--no-warmup", "--lora-modules", "a=/a", "--lora-modules", "b=/b"]


@pytest.mark.parametrize("args, message", [
    ({"port": 8000}, "loopback port of its own"),
    ({"no_such_flag": 1}, "not flags of `jaxserve serve`"),
    ({"coordinator_address": "h:1"}, "set by the Ray launcher"),
])
def test_build_app_refuses_what_a_replica_cannot_take(args, message):
    with pytest.raises(ValueError, match=message):
        serve_flags(args)


def test_host_flags():
    assert http_address(["--host", "0.0.0.0", "--port", "9000"], 2) == ("0.0.0.0", 9000)
    with pytest.raises(ValueError, match="--num-processes 3 but 2 hosts"):
        http_address(["--num-processes", "3"], 2)
    with pytest.raises(ValueError, match="not with --distributed-executor-backend ray"):
        http_address(["--distributed-executor-backend", "ray"], 2)
    # An actor asks for exactly its bundle (no default CPU a bundle of accelerators lacks).
    assert actor_options({"TPU": 4}) == {"num_cpus": 0, "num_gpus": 0, "resources": {"TPU": 4}}
    assert actor_options({"CPU": 2, "GPU": 1}) == {"num_cpus": 2, "num_gpus": 1, "resources": {}}


def test_command_line_of_each_placed_process():
    argv = ["serve", "--distributed-executor-backend", "ray", "--num-processes", "2", "--model", "/m"]
    assert process_args(argv) == ["--distributed-executor-backend", "ray", "--num-processes", "2", "--model", "/m",
                                  "--distributed-executor-backend", "external_launcher"]  # the last one counts
    assert ray_bundle('{"TPU": 4}') == {"TPU": 4} and ray_bundle(None) is None
    for bad in ("TPU", '{"TPU": 0}', "[4]", '{"TPU": true}'):
        with pytest.raises(ValueError, match="--ray-bundle"):
            ray_bundle(bad)


@pytest.mark.parametrize("argv, message", [
    (["--num-processes", "2", "--coordinator-address", "h:1"], "sets --coordinator-address itself"),
    ([], "give --num-processes"),
    (["--num-processes", "2"], "pip install 'jaxserve\\[ray\\]'"),
])
def test_ray_serve_command_errors_are_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed: `import ray` fails
    assert main(["serve", "--distributed-executor-backend", "ray", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxserve: error:"), err
    assert __import__("re").search(message, err), err


class CutStream:
    """An aiohttp answer of an event stream whose server goes away after one event."""
    headers = {"content-type": "text/event-stream"}
    released = False

    class content:
        @staticmethod
        async def iter_any():
            yield b'data: {"choices": []}\n\n'
            raise aiohttp.ClientPayloadError("connection lost")

    def release(self):
        self.released = True


def test_a_stream_cut_off_by_the_server_ends_with_an_openai_error_event():
    answer = CutStream()

    async def relayed():
        return [chunk async for chunk in JaxserveReplica.relay(None, answer)]
    chunks = asyncio.run(relayed())
    assert chunks[0] == b'data: {"choices": []}\n\n' and answer.released
    error, done = chunks[1].decode().strip().split("\n\n")
    assert json.loads(error.removeprefix("data: "))["error"]["type"] == "server_error"
    assert done == "data: [DONE]"


def test_nothing_imports_ray_until_it_is_used():
    """`import jaxserve`, the command line and the scale-out modules load without Ray (it is an optional extra)."""
    code = ("import sys; sys.modules['ray'] = None; import jaxserve, jaxserve.cli, jaxserve.scaleout.hosts, "
            "jaxserve.scaleout.replicas, jaxserve.scaleout.launch; jaxserve.cli.build_parser(); print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.stdout.strip() == "ok", run.stderr[-2000:]
