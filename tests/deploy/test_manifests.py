"""The manifests under deploy/ (Kubernetes, the inference gateway) and the image recipe, checked offline: no cluster
is reachable here, so every document is validated against its schema and read for what it must mean.

Core kinds go through kubernetes-validate's strict schemas of Kubernetes 1.37 (unknown fields rejected, as
`kubectl apply`'s default server-side validation does); custom resources through their published openAPIV3Schema,
vendored in tests/data/crds (see its README), made strict the way the API server prunes: an object that lists its
properties takes no others unless the schema says so. A kind with neither schema fails, so no manifest can be added
unvalidated. Then the meaning: the LeaderWorkerSet's restart policy and `--coordinator-address lws`, probes on
/health at the port the command serves, the coordinator secret from a Secret, the endpoint picker reading jaxserve's
metric names, the Dockerfile installing as the README does.
"""
from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from jaxserve.cli.parser import build_parser
from jaxserve.openai.metrics import GATEWAY_METRICS

from locations import DATA, ROOT

DEPLOY = ROOT / "deploy"
CRDS = DATA / "crds"
KUBERNETES_VERSION = "1.37.0"  # kubernetes-validate's newest schemas (pinned in pyproject's test extras)
SECRET_ENV = "JAXSERVE_COORDINATOR_SECRET"  # jaxserve.multihost.process.SECRET_ENV, without importing jax's runtime
# The EndpointPickerConfig field of llm-d-router v0.9.0's core-metrics-extractor for each metric of the gateway's
# model-server protocol; the names are those the server exports (jaxserve.openai.metrics.GATEWAY_METRICS).
EPP_FIELDS = {"queuedRequestsSpec": "TotalQueuedRequests", "runningRequestsSpec": "TotalRunningRequests",
              "kvUsageSpec": "KVCacheUtilization", "loraSpec": "LoRAInfo", "cacheInfoSpec": "CacheInfo"}
EPP_METRICS = {field: GATEWAY_METRICS[metric] for field, metric in EPP_FIELDS.items()}
# Plugin types registered by llm-d-router v0.9.0's EPP (cmd/epp/runner/runner.go) that the example uses.
EPP_PLUGIN_TYPES = {"metrics-data-source", "core-metrics-extractor", "queue-scorer", "kv-cache-utilization-scorer",
                    "prefix-cache-scorer", "lora-affinity-scorer", "max-score-picker", "single-profile-handler"}


# --- loading and validating ---------------------------------------------------------------------------------------

def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def all_documents() -> list[dict]:
    return [d for path in manifest_files() for d in documents(path)]


def of_kind(kind: str) -> list[dict]:
    return [d for d in all_documents() if d["kind"] == kind]


def strict(schema):
    """The schema as the API server applies it: an object node that lists its properties, with no
    additionalProperties and no x-kubernetes-preserve-unknown-fields, takes no other field."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k != "properties" else {name: strict(s) for name, s in v.items()}
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict schema of each vendored custom resource."""
    schemas = {}
    for path in sorted(CRDS.glob("*.json")):
        crd = json.loads(path.read_text())
        schemas[(f"{crd['group']}/{crd['version']}", crd["kind"])] = strict(crd["openAPIV3Schema"])
    return schemas


CRD_SCHEMAS = crd_schemas()


def validate(doc: dict) -> None:
    """Raises if the document does not validate (jsonschema.ValidationError), or has no schema here."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        jsonschema.Draft202012Validator(CRD_SCHEMAS[key]).validate(doc)
        # The resource's own metadata is `type: object` in a CRD schema: check it as the core kinds' ObjectMeta;
        # pod templates embedded in it as Kubernetes' own PodTemplate (the CRD's copy may be of an older release).
        core_validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]})
        for role, template in pod_templates(doc).items():
            core_validate({"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": f"{doc['metadata']['name']}-{role}"}, "template": template})
        return
    try:
        core_validate(doc)
    except kubernetes_validate.SchemaNotFoundError as e:
        raise AssertionError(f"{key}: no schema (not a Kubernetes {KUBERNETES_VERSION} kind, nor a CRD vendored in "
                             f"{CRDS.relative_to(ROOT)}): {e.message}") from None


def core_validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def pod_templates(doc: dict) -> dict[str, dict]:
    """The pod templates of a workload, by role."""
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}
    if doc["kind"] == "Deployment":
        return {"pod": doc["spec"]["template"]}
    return {}


# --- reading commands ---------------------------------------------------------------------------------------------

def serve_args(container: dict):
    """The container's `jaxserve serve` command line, parsed by jaxserve's own parser (an unknown flag fails)."""
    command = container.get("command", []) + container.get("args", [])
    assert command[:2] == ["jaxserve", "serve"], f"{container['name']} runs {command[:2]}, not `jaxserve serve`"
    return build_parser().parse_args(command[1:])


def flag(args, name: str):
    return getattr(args, name.lstrip("-").replace("-", "_"))


def container_port(container: dict, port) -> int:
    """A probe's port (a number or the name of one of the container's ports) as a number."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"port {port!r} is not one of {container['name']}'s ports {named}"
    return named[port]


def jaxserve_containers() -> list[tuple[str, dict, dict]]:
    """(workload/role, pod template, container) for every container running jaxserve."""
    found = []
    for doc in all_documents():
        for role, template in pod_templates(doc).items():
            for c in template["spec"]["containers"]:
                if (c.get("command") or [""])[0] == "jaxserve":
                    found.append((f"{doc['metadata']['name']}/{role}", template, c))
    return found


def served_pods() -> list[tuple[str, dict, dict]]:
    """(workload/role, labels, pod template) of every workload's pods; a LeaderWorkerSet's pods carry the labels its
    controller adds too (the set's name; worker index 0 on the leader)."""
    pods = []
    for doc in all_documents():
        for role, template in pod_templates(doc).items():
            labels = dict(template["metadata"].get("labels", {}))
            if doc["kind"] == "LeaderWorkerSet":
                labels["leaderworkerset.sigs.k8s.io/name"] = doc["metadata"]["name"]
                if role == "leader":
                    labels["leaderworkerset.sigs.k8s.io/worker-index"] = "0"
            pods.append((f"{doc['metadata']['name']}/{role}", labels, template))
    return pods


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- every document validates ---------------------------------------------------------------------------------------

def test_manifests_exist():
    names = {p.relative_to(DEPLOY).as_posix() for p in manifest_files()}
    assert {"k8s/tpu-slice-lws.yaml", "k8s/gpu-replicas.yaml", "gateway/inference-pool.yaml",
            "gateway/epp.yaml"} <= names, names


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_every_document_validates(path):
    docs = documents(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        validate(doc)


def lws():
    (doc,) = of_kind("LeaderWorkerSet")
    return doc


def deployment(name: str):
    (doc,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == name]
    return doc


def copy_at(doc: dict, path: str):
    """A deep copy of doc, the node holding the field at dotted path (list indices as numbers), and its key."""
    broken = copy.deepcopy(doc)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = broken
    for p in parents:
        node = node[p]
    return broken, node, last


def set_path(doc: dict, path: str, value) -> dict:
    """A deep copy of doc with the field at dotted path set to value."""
    broken, node, key = copy_at(doc, path)
    node[key] = value
    return broken


# Each a one-field break of a real manifest that its schema must catch: an enum, an unknown field (strictness),
# a wrong type, a missing required field, a kind with no schema.
def without(doc: dict, path: str) -> dict:
    """A deep copy of doc without the field at dotted path."""
    broken, node, key = copy_at(doc, path)
    del node[key]
    return broken


BREAKS = {  # name: (the broken copy, what the error must say)
    "lws restartPolicy not an enum value": (lambda: set_path(lws(), "spec.leaderWorkerTemplate.restartPolicy",
                                                             "RestartWhenever"), "is not one of"),
    "lws unknown field": (lambda: set_path(lws(), "spec.leaderWorkerTemplate.sizes", 4), "'sizes' was unexpected"),
    "lws leader container unknown field": (lambda: set_path(
        lws(), "spec.leaderWorkerTemplate.leaderTemplate.spec.containers.0.imagee", "x"), "'imagee' was unexpected"),
    "lws size a string": (lambda: set_path(lws(), "spec.leaderWorkerTemplate.size", "four"), "not of type 'integer'"),
    "deployment container unknown field": (lambda: set_path(
        deployment("jaxserve-gpu"), "spec.template.spec.containers.0.imagee", "x"), "'imagee' was unexpected"),
    "deployment probe port a list": (lambda: set_path(
        deployment("jaxserve-gpu"), "spec.template.spec.containers.0.readinessProbe.httpGet.port", [8000]),
        "is not valid under any of the given schemas"),
    "inferencepool without targetPorts": (lambda: without(of_kind("InferencePool")[0], "spec.targetPorts"),
                                          "'targetPorts' is a required property"),
    "httproute unknown field": (lambda: set_path(of_kind("HTTPRoute")[0], "spec.rules.0.backendRef", {}),
                                "'backendRef' was unexpected"),
    "unknown kind": (lambda: {**of_kind("InferencePool")[0], "kind": "InferencePoool"}, "no schema"),
}


@pytest.mark.parametrize("name", BREAKS)
def test_a_broken_manifest_fails_validation(name):
    make, message = BREAKS[name]
    broken = make()
    with pytest.raises((jsonschema.ValidationError, AssertionError), match=re.escape(message)):
        validate(broken)


# --- what the manifests mean ----------------------------------------------------------------------------------------

def test_lws_group_restarts_and_starts_as_one():
    spec = lws()["spec"]
    # One process dying ends the others (heartbeats): the group restarts as a whole.
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The leader is ready only once every worker joined: workers must not wait for its readiness.
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"


def test_lws_runs_one_serve_command_on_every_host():
    lwt = lws()["spec"]["leaderWorkerTemplate"]
    (leader,) = lwt["leaderTemplate"]["spec"]["containers"]
    (worker,) = lwt["workerTemplate"]["spec"]["containers"]
    args = serve_args(leader)
    assert re.fullmatch(r"lws(:\d+)?", flag(args, "--coordinator-address")), flag(args, "--coordinator-address")
    # lws reads the group's size and this pod's index: none passed (which would need arithmetic in a shell).
    assert flag(args, "--num-processes") is None and flag(args, "--process-id") is None
    assert worker["command"] == leader["command"] and worker.get("args") == leader.get("args")
    assert worker["image"] == leader["image"]


def test_lws_slice_sizes_agree():
    """Every chip of the slice in one engine: --tensor-parallel-size = hosts x chips per host, and leader and
    workers ask for the same TPU type, topology and chips."""
    lwt = lws()["spec"]["leaderWorkerTemplate"]
    leader, worker = lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]
    assert leader["nodeSelector"] == worker["nodeSelector"]
    assert {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"} <= set(leader["nodeSelector"])
    chips = [int(s["containers"][0]["resources"]["limits"]["google.com/tpu"]) for s in (leader, worker)]
    assert chips[0] == chips[1]
    assert int(flag(serve_args(leader["containers"][0]), "--tensor-parallel-size")) == lwt["size"] * chips[0]


def test_gpu_replicas_gpus_match_tensor_parallelism():
    (c,) = deployment("jaxserve-gpu")["spec"]["template"]["spec"]["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == int(flag(serve_args(c), "--tensor-parallel-size"))


def probe_errors(where: str, c: dict) -> list[str]:
    """What is wrong with a jaxserve container's probes: HTTP probes must hit /health at the port `serve` listens on,
    on an address the kubelet reaches; an LWS worker serves no HTTP (only process 0 does), so it has no HTTP probe."""
    args = serve_args(c)
    probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}
    if where.endswith("/worker"):
        return [f"{where}: {k} probes HTTP on a worker" for k, p in probes.items() if "httpGet" in p]
    errors = [f"{where}: no {k}" for k in ("readinessProbe", "livenessProbe") if k not in probes]
    if flag(args, "--host") not in ("0.0.0.0", "::"):
        errors.append(f"{where}: --host {flag(args, '--host')} is not reachable from the kubelet")
    for kind, probe in probes.items():
        get = probe.get("httpGet", {})
        if get.get("path") != "/health" or container_port(c, get.get("port")) != flag(args, "--port"):
            errors.append(f"{where}: {kind} {get} is not /health on port {flag(args, '--port')}")
    return errors


def secret_errors(where: str, c: dict) -> list[str]:
    """A multi-process server must read JAXSERVE_COORDINATOR_SECRET from a Secret (secretKeyRef), never a literal."""
    env = {e["name"]: e for e in c.get("env", [])}
    if SECRET_ENV in env and "value" in env[SECRET_ENV]:
        return [f"{where}: {SECRET_ENV} is a literal"]
    if not flag(serve_args(c), "--coordinator-address"):
        return []
    if SECRET_ENV in env:
        return [] if env[SECRET_ENV].get("valueFrom", {}).get("secretKeyRef") else [f"{where}: not a secretKeyRef"]
    return [] if flag(serve_args(c), "--coordinator-secret-file") else [f"{where}: no coordinator secret"]


@pytest.mark.parametrize("where", [w for w, _, _ in jaxserve_containers()])
def test_probes_hit_health_on_the_served_port(where):
    ((_, _, c),) = [x for x in jaxserve_containers() if x[0] == where]
    assert probe_errors(where, c) == []


def test_coordinator_secret_comes_from_a_secret():
    """Every multi-process server reads the secret from a Secret; no Secret with a value is committed."""
    assert any(flag(serve_args(c), "--coordinator-address") for _, _, c in jaxserve_containers())
    for where, _, c in jaxserve_containers():
        assert secret_errors(where, c) == []
    for secret in of_kind("Secret"):
        assert not secret.get("data") and not secret.get("stringData"), secret["metadata"]["name"]


def leader_container() -> dict:
    return copy.deepcopy(lws()["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0])


def with_flag(c: dict, name: str, value: str) -> dict:
    command = list(c["command"])
    command[command.index(name) + 1] = value
    return {**c, "command": command}


# Breaks of the leader's container that the meaning checks must catch.
MEANING_BREAKS = {
    "probe on another port": (probe_errors, lambda c: with_flag(c, "--port", "8001")),
    "probe on another path": (probe_errors, lambda c: {**c, "livenessProbe": {"httpGet": {"path": "/v1/models",
                                                                                          "port": "http"}}}),
    "server on loopback": (probe_errors, lambda c: with_flag(c, "--host", "127.0.0.1")),
    "no readiness probe": (probe_errors, lambda c: {k: v for k, v in c.items() if k != "readinessProbe"}),
    "literal secret": (secret_errors, lambda c: {**c, "env": [{"name": SECRET_ENV, "value": "0123456789abcdef"}]}),
    "no secret": (secret_errors, lambda c: {**c, "env": []}),
}


@pytest.mark.parametrize("name", MEANING_BREAKS)
def test_a_broken_leader_fails_the_meaning_checks(name):
    check, breaks = MEANING_BREAKS[name]
    assert check("jaxserve-tpu/leader", leader_container()) == []
    assert check("jaxserve-tpu/leader", breaks(leader_container())), name


def test_services_and_budgets_select_serving_pods():
    """Each Service selects pods that serve HTTP (never an LWS worker) on a port those pods name; each
    PodDisruptionBudget selects a workload's pods."""
    pods = served_pods()
    for svc in of_kind("Service"):
        picked = [(w, t) for w, labels, t in pods if selects(svc["spec"]["selector"], labels)]
        assert picked, f"Service {svc['metadata']['name']} selects no pod"
        for w, t in picked:
            assert not w.endswith("/worker"), f"Service {svc['metadata']['name']} selects {w}"
            names = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
            assert all(p["targetPort"] in names for p in svc["spec"]["ports"]), (svc["metadata"]["name"], names)
    for pdb in of_kind("PodDisruptionBudget"):
        assert any(selects(pdb["spec"]["selector"]["matchLabels"], labels) for _, labels, _ in pods)


def test_dockerfile_installs_as_the_readme_does():
    readme = (ROOT / "README.md").read_text()
    first_command = re.search(r"```\n(.*?)\n```", readme, re.S).group(1)
    (install,) = [part.strip() for part in first_command.split("&&") if part.strip().startswith("pip install")]
    runs = [line.removeprefix("RUN ").strip() for line in (DEPLOY / "Dockerfile").read_text().splitlines()
            if line.startswith("RUN ")]
    assert install in runs, f"the README installs with {install!r}; the Dockerfile runs {runs}"
    # The accelerator build of jax is pinned to the version the project's own extras pin.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pinned,) = [re.search(r"==(.+)$", r).group(1) for r in extras["tpu-aot"] if r.startswith("jax[")]
    assert f"ARG JAX_VERSION={pinned}" in (DEPLOY / "Dockerfile").read_text()


# --- the gateway ----------------------------------------------------------------------------------------------------

def epp_config() -> dict:
    (cm,) = [c for c in of_kind("ConfigMap") if c["metadata"]["name"] == "jaxserve-epp"]
    return yaml.safe_load(cm["data"]["epp-config.yaml"])


def test_endpoint_picker_reads_jaxserve_metric_names():
    config = epp_config()
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert {p["type"] for p in plugins.values()} <= EPP_PLUGIN_TYPES
    extractor = plugins["core-metrics-extractor"]["parameters"]
    engines = {e["name"]: e for e in extractor["engineConfigs"]}
    assert extractor["defaultEngine"] in engines
    for name, engine in engines.items():
        assert {k: engine[k] for k in EPP_METRICS} == EPP_METRICS, name
    # Every server pod names an engine the picker knows (the label it reads).
    for where, template, _ in jaxserve_containers():
        if not where.endswith("/worker"):
            assert template["metadata"]["labels"]["llm-d.ai/engine-type"] in engines, where
    # Every reference is to a declared plugin.
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(plugins), set(refs) - set(plugins)


def test_pool_picker_and_route_fit_together():
    (pool,) = of_kind("InferencePool")
    (route,) = of_kind("HTTPRoute")
    epp = deployment(pool["spec"]["endpointPickerRef"]["name"])
    (epp_service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == epp["metadata"]["name"]]
    # The picker's Service port as the pool names it; the picker watches this pool.
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in c["args"]
    # The pool's pods serve HTTP at its target port (the port they serve /metrics on too); workers are never picked.
    picked = [(w, t) for w, labels, t in served_pods() if selects(pool["spec"]["selector"]["matchLabels"], labels)]
    assert picked and not any(w.endswith("/worker") for w, _ in picked), [w for w, _ in picked]
    for w, t in picked:
        (server,) = [c for c in t["spec"]["containers"] if c["command"][0] == "jaxserve"]
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [flag(serve_args(server), "--port")], w
    # The route sends to this pool.
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]
