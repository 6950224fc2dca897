"""`--coordinator-address lws` / `lws:PORT`: the processes of a Kubernetes LeaderWorkerSet group from the variables
it sets in every pod, and the errors that name what is missing or malformed (no processes: the multi-process runs
through it are in test_multihost.py)."""
import pytest

from jaxserve import EngineConfig
from jaxserve.cli import build_parser
from jaxserve.multihost.cluster_env import lws_bind_address, lws_cluster, lws_port
from jaxserve.options import LWS_DEFAULT_PORT

GOOD = {"LWS_LEADER_ADDRESS": "jaxserve-0.jaxserve.default", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}


@pytest.mark.parametrize("address, port", [("lws", LWS_DEFAULT_PORT), ("lws:1234", 1234), ("lws:65535", 65535),
                                           ("127.0.0.1:1234", None), ("auto", None), (None, None),
                                           ("lwshost:1234", None)])
def test_the_port_of_an_lws_address(address, port):
    assert lws_port(address) == port


@pytest.mark.parametrize("address", ["lws:", "lws:0", "lws:65536", "lws:http", "lws:-1", "lws:1_000", "lws: 80",
                                     "lws:80:81"])
def test_a_bad_port_is_refused(address):
    with pytest.raises(ValueError, match="the port after 'lws:' must be an integer in 1-65535"):
        lws_port(address)


def test_a_group_gives_the_leader_address_size_and_index():
    assert lws_cluster("lws", GOOD) == (f"jaxserve-0.jaxserve.default:{LWS_DEFAULT_PORT}", 4, 2)
    assert lws_cluster("lws:9000", {**GOOD, "LWS_WORKER_INDEX": "0"}) == ("jaxserve-0.jaxserve.default:9000", 4, 0)
    assert lws_cluster("lws:9000", {**GOOD, "LWS_LEADER_ADDRESS": " 10.0.0.5\n"})[0] == "10.0.0.5:9000"
    assert lws_cluster("lws:9000", {**GOOD, "LWS_LEADER_ADDRESS": "fd00::5"})[0] == "[fd00::5]:9000"
    assert lws_cluster("lws", {**GOOD, "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"})[1:] == (1, 0)


@pytest.mark.parametrize("name", sorted(GOOD))
def test_a_missing_variable_is_named(name):
    env = {k: v for k, v in GOOD.items() if k != name}
    with pytest.raises(ValueError, match=f"--coordinator-address lws needs {name} \\(set by LeaderWorkerSet in "
                                         "every pod\\); not set"):
        lws_cluster("lws", env)
    with pytest.raises(ValueError, match=f"needs {name} .*; set but empty"):
        lws_cluster("lws", {**env, name: " "})


@pytest.mark.parametrize("name, value, why", [
    ("LWS_GROUP_SIZE", "four", "LWS_GROUP_SIZE must be an integer >= 1, got 'four'"),
    ("LWS_GROUP_SIZE", "0", "LWS_GROUP_SIZE must be an integer >= 1, got '0'"),
    ("LWS_GROUP_SIZE", "-2", "LWS_GROUP_SIZE must be an integer >= 1"),
    ("LWS_WORKER_INDEX", "1.0", "LWS_WORKER_INDEX must be an integer >= 0, got '1.0'"),
    ("LWS_WORKER_INDEX", "-1", "LWS_WORKER_INDEX must be an integer >= 0"),
    ("LWS_WORKER_INDEX", "4", r"LWS_WORKER_INDEX must be in \[0, LWS_GROUP_SIZE = 4\), got 4"),
    ("LWS_LEADER_ADDRESS", "leader:8476", "LWS_LEADER_ADDRESS must be the leader's host name or address, without a "
                                          "port"),
])
def test_a_malformed_variable_is_named(name, value, why):
    with pytest.raises(ValueError, match=why):
        lws_cluster("lws", {**GOOD, name: value})


def test_the_leader_binds_every_interface_for_a_name_and_an_address_as_it_is():
    """A pod's DNS name may not resolve yet when the leader starts (and a pod's interfaces are its own): every
    interface; an address literal (processes on one host: 127.0.0.1) keeps the service on that address."""
    assert lws_bind_address("jaxserve-0.jaxserve.default:8476") == "[::]:8476"
    assert lws_bind_address("127.0.0.1:8476") == "127.0.0.1:8476"
    assert lws_bind_address("[fd00::5]:9000") == "[fd00::5]:9000"


def test_the_config_takes_lws_alone():
    assert EngineConfig(coordinator_address="lws").coordinator_address == "lws"
    assert EngineConfig(coordinator_address="lws:9000").num_processes is None
    for given in (dict(num_processes=2), dict(process_id=0), dict(num_processes=2, process_id=0)):
        with pytest.raises(ValueError, match="reads the processes from LeaderWorkerSet's LWS_GROUP_SIZE and "
                                             "LWS_WORKER_INDEX: give no num_processes or process_id"):
            EngineConfig(coordinator_address="lws", **given)
    with pytest.raises(ValueError, match="port after 'lws:'"):
        EngineConfig(coordinator_address="lws:abc")


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"], ["chat"]])
def test_every_command_takes_lws(command):
    args = build_parser().parse_args([*command, "--coordinator-address", "lws:9000"])
    assert EngineConfig.from_cli_args(args).coordinator_address == "lws:9000"
    args = build_parser().parse_args([*command, "--coordinator-address", "lws", "--process-id", "1"])
    with pytest.raises(ValueError, match="give no num_processes or process_id"):
        EngineConfig.from_cli_args(args)


def test_initialize_reads_the_group(monkeypatch):
    """jax.distributed starts with the group's place: the leader's address and port, its size, this index."""
    import jax

    from jaxserve import multihost
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(multihost.process, "hold_sigterm", lambda: None)
    for name, value in GOOD.items():
        monkeypatch.setenv(name, value)
    multihost.initialize("lws:9000", None, None)
    multihost.initialize("lws", None, None, "10.0.0.7:8476")
    assert [(c["coordinator_address"], c["num_processes"], c["process_id"], c["coordinator_bind_address"])
            for c in calls] == [("jaxserve-0.jaxserve.default:9000", 4, 2, "[::]:9000"),
                                (f"jaxserve-0.jaxserve.default:{LWS_DEFAULT_PORT}", 4, 2, "10.0.0.7:8476")]
    monkeypatch.delenv("LWS_GROUP_SIZE")
    with pytest.raises(ValueError, match="needs LWS_GROUP_SIZE"):
        multihost.initialize("lws", None, None)
