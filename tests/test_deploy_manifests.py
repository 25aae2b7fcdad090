"""The Kubernetes manifests (deploy/kubernetes/), offline: every resource validates against
the Kubernetes schemas of a pinned version (``kubernetes-validate``, strict: unknown fields
are errors), and the resources agree with each other and with blockq: Services select pods
that exist and name ports they open, every ConfigMap / Secret key referenced exists,
container args are real flags of blockq's commands (parsed by ``blockq.cli.main.build_parser``),
probes hit the health endpoints those args serve, and the settings parse as blockq parses
them (with the secrets an operator sets: tests/test_secrets.py checks the shipped
placeholders, the passwords of Redis and the Sentinels, the predictor's token).
NetworkPolicies allow the pipeline's own traffic and nothing else (each policy is shown to
be needed), and the components whose consumer names must be stable are StatefulSets."""

from __future__ import annotations

import base64
import copy
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from blockq.cli.main import build_parser
from blockq.config import Settings
from blockq.frontdoors.gateway.config import gateway_config_from_env
from blockq.wire.redis_url import PLACEHOLDER_SECRET, parse_redis_url
from tests.conftest import REPO_ROOT

K8S_VERSION = "1.30.0"
MANIFEST_DIR = REPO_ROOT / "deploy" / "kubernetes"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
METRICS_PORT = 9400
# The HTTP port and health path each command serves, as its args say (flag, path).
HEALTH_ENDPOINTS = {"gateway": ("port", "/healthz"), "predictor": ("http_port", "/healthz"),
                    "dispatcher": ("metrics_port", "/metrics"), "worker": ("metrics_port", "/metrics")}
SECRET_NAME = "blockq-secrets"
# What an operator puts in place of the placeholders of secret.yaml.
REAL_SECRETS = {"redis-password": "data-pw-2f9c81e0", "redis-sentinel-password": "sentinel-pw-77d1e0aa",
                "predictor-http-token": "token-5b1f0c9e2a7d4c3b", "gateway-api-keys": "sk-test-4f1c=default"}


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((MANIFEST_DIR / "kustomization.yaml").read_text())


def _load() -> list[tuple[str, dict[str, Any]]]:
    documents = []
    for name in _kustomization()["resources"]:
        for document in yaml.safe_load_all((MANIFEST_DIR / name).read_text()):
            if document:
                documents.append((name, document))
    return documents


DOCUMENTS = _load()


def _named(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in DOCUMENTS if d["kind"] == kind}


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in DOCUMENTS if d["kind"] in WORKLOAD_KINDS]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return workload["spec"]["template"]["spec"]["containers"]


def _blockq_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(w, c) for w in _workloads() for c in _containers(w) if c.get("command") == ["blockq"]]


def _secret_data(secret: dict[str, Any]) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def _filled_secrets() -> dict[str, str]:
    """blockq-secrets as an operator fills it: every placeholder replaced (REAL_SECRETS)."""
    data = _secret_data(_named("Secret")[SECRET_NAME])
    filled = {key: REAL_SECRETS.get(key, value) for key, value in data.items()}
    filled["redis-url"] = (data["redis-url"]
                           .replace(f":{PLACEHOLDER_SECRET}@", f":{REAL_SECRETS['redis-password']}@")
                           .replace(f"sentinel_password={PLACEHOLDER_SECRET}",
                                    f"sentinel_password={REAL_SECRETS['redis-sentinel-password']}"))
    assert PLACEHOLDER_SECRET not in str(filled)
    return filled


def _source_data(kind: str, name: str, filled: bool = False) -> dict[str, str]:
    """The keys of the ConfigMap or Secret ``name`` (KeyError: no such object);
    ``filled``: blockq-secrets with its placeholders replaced."""
    if kind == "configMap":
        return dict(_named("ConfigMap")[name].get("data") or {})
    if filled and name == SECRET_NAME:
        return _filled_secrets()
    return _secret_data(_named("Secret")[name])


def _container_env(workload: dict[str, Any], container: dict[str, Any], filled: bool = True) -> dict[str, str]:
    """The container's environment as the kubelet builds it (``env`` over ``envFrom``);
    ``metadata.name`` is the workload's first pod's name. ``filled``: with the secrets an
    operator sets (False: the placeholders of secret.yaml)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_source_data("configMap", source["configMapRef"]["name"]))
        else:
            env.update(_source_data("secret", source["secretRef"]["name"], filled))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "metadata.name"
            env[var["name"]] = f"{workload['metadata']['name']}-0"
        elif "configMapKeyRef" in ref:
            env[var["name"]] = _source_data("configMap", ref["configMapKeyRef"]["name"])[ref["configMapKeyRef"]["key"]]
        else:
            env[var["name"]] = _source_data("secret", ref["secretKeyRef"]["name"], filled)[ref["secretKeyRef"]["key"]]
    return env


def _expanded_args(workload: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """The args with ``$(VAR)`` replaced as Kubernetes does (from the container's env)."""
    env = _container_env(workload, container)
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]


def _container_port(container: dict[str, Any], port: int | str) -> int:
    """The number of ``port`` (a number, or one of the container's port names)."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in container.get("ports", [])], port
        return port
    by_name = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in by_name, f"{container['name']} has no port named {port!r}"
    return by_name[port]


# --- the manifests as Kubernetes reads them ---------------------------------------------------

def test_kustomization_lists_every_manifest() -> None:
    listed = _kustomization()["resources"]
    on_disk = sorted(p.name for p in MANIFEST_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk
    assert len(set(listed)) == len(listed)
    keys = [(d["kind"], d["metadata"]["name"]) for _, d in DOCUMENTS]
    assert len(set(keys)) == len(keys), "two resources of one kind share a name"
    assert {d["metadata"].get("namespace", "blockq") for _, d in DOCUMENTS if d["kind"] != "Namespace"} == {"blockq"}


@pytest.mark.parametrize(("name", "document"), DOCUMENTS,
                         ids=[f"{name}:{d['kind']}/{d['metadata']['name']}" for name, d in DOCUMENTS])
def test_manifest_validates_against_the_kubernetes_schema(name: str, document: dict[str, Any]) -> None:
    assert kubernetes_validate.validate(document, K8S_VERSION, strict=True) == "1.30"


def test_the_schema_check_catches_mistakes() -> None:
    deployment = copy.deepcopy(_named("StatefulSet")["blockq-dispatcher"])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    deployment = copy.deepcopy(_named("StatefulSet")["blockq-dispatcher"])
    deployment["spec"]["replicas"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# --- cross-references --------------------------------------------------------------------------

def test_workloads_select_their_own_pods() -> None:
    for workload in _workloads():
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]


def test_services_select_pods_that_open_their_ports() -> None:
    for name, service in _named("Service").items():
        selector = service["spec"]["selector"]
        matched = [w for w in _workloads() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"service {name} selects {len(matched)} workloads"
        containers = _containers(matched[0])
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in [p.get("name"), p["containerPort"]] for c in containers for p in c.get("ports", [])), \
                f"service {name}: no container port {target!r}"


def test_statefulsets_have_headless_governing_services() -> None:
    services = _named("Service")
    for name, statefulset in _named("StatefulSet").items():
        service = services[statefulset["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None", name
        assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()


def test_every_referenced_config_key_secret_key_and_claim_exists() -> None:
    claims = set(_named("PersistentVolumeClaim"))
    for workload in _workloads():
        for container in _containers(workload):
            _container_env(workload, container)  # KeyError on a missing object or key
        template_claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                data = _source_data("configMap", volume["configMap"]["name"])
                assert all(item["key"] in data for item in volume["configMap"].get("items", []))
            if "secret" in volume:
                _source_data("secret", volume["secret"]["secretName"])
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for container in _containers(workload):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in template_claims, mount["name"]


def test_redis_scripts_sourced_and_run_exist_and_parse() -> None:
    scripts = _source_data("configMap", "blockq-redis-scripts")
    redis = _named("StatefulSet")["blockq-redis"]
    for container in _containers(redis):
        assert container["command"][0] == "sh" and Path(container["command"][1]).name in scripts
    for name, text in scripts.items():
        for sourced in re.findall(r"^\s*\. /scripts/(\S+)", text, flags=re.MULTILINE):
            assert sourced in scripts, f"{name} sources a missing {sourced}"
    if shutil.which("sh") is None:
        pytest.skip("no sh to check the scripts' syntax")
    for name, text in scripts.items():
        result = subprocess.run(["sh", "-n"], input=text, capture_output=True, text=True, timeout=10)
        assert result.returncode == 0, f"{name}: {result.stderr}"


# --- agreement with blockq ---------------------------------------------------------------------

@pytest.mark.parametrize(("workload", "container"), _blockq_containers(),
                         ids=[w["metadata"]["name"] for w, _ in _blockq_containers()])
def test_container_args_are_real_blockq_flags(workload: dict[str, Any], container: dict[str, Any]) -> None:
    args = build_parser().parse_args(_expanded_args(workload, container))  # exits on an unknown flag
    command = args.command
    assert command in HEALTH_ENDPOINTS, command
    flag, path = HEALTH_ENDPOINTS[command]
    served_port = int(getattr(args, flag))
    if path == "/metrics":
        assert served_port == METRICS_PORT and args.metrics_host == "0.0.0.0"
    probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
    assert {"readinessProbe", "livenessProbe"} <= container.keys()
    for probe in probes:
        assert probe["httpGet"]["path"] == path, (command, probe)
        assert _container_port(container, probe["httpGet"]["port"]) == served_port, (command, probe)


def test_settings_parse_as_blockq_parses_them() -> None:
    redis_pods = _named("StatefulSet")["blockq-redis"]
    sentinel = next(c for c in _containers(redis_pods) if c["name"] == "sentinel")
    sentinel_env = _container_env(redis_pods, sentinel)
    for workload, container in _blockq_containers():
        env = _container_env(workload, container)
        settings = Settings.from_env(env)
        target = parse_redis_url(settings.redis_url or "")
        # The Sentinel form, pointing at the Sentinels of redis-sentinel.yaml.
        assert target.kind == "sentinel" and target.service_name == sentinel_env["SENTINEL_SERVICE"]
        pods = {f"{redis_pods['metadata']['name']}-{i}.{redis_pods['spec']['serviceName']}"
                for i in range(redis_pods["spec"]["replicas"])}
        assert {host for host, _ in target.nodes} == pods
        assert {port for _, port in target.nodes} == {_container_port(sentinel, "sentinel")}
        # The data nodes' password, and the Sentinels' own (their requirepass).
        assert target.password == sentinel_env["REDIS_PASSWORD"] == REAL_SECRETS["redis-password"]
        assert dict(target.sentinel_options)["sentinel_password"] == sentinel_env["REDIS_SENTINEL_PASSWORD"]
        if env.get("BLOCKQ_GATEWAY_API_KEYS"):
            args = build_parser().parse_args(_expanded_args(workload, container))
            config = gateway_config_from_env(env, host=args.host, port=args.port)
            assert config.auth_required and config.host == "0.0.0.0"


def test_one_gpu_per_worker_pod_and_stable_instance_ids() -> None:
    workers = _named("StatefulSet")["blockq-worker"]
    (container,) = _containers(workers)
    for section in ("requests", "limits"):
        assert str(container["resources"][section]["nvidia.com/gpu"]) == "1"
    args = build_parser().parse_args(_expanded_args(workers, container))
    assert args.instance_id == "blockq-worker-0" and args.instances is None  # the pod's own name
    # Draining takes as long as the longest request: the kubelet must wait for it.
    assert workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 300


def test_two_dispatchers_one_leader() -> None:
    assert _named("StatefulSet")["blockq-dispatcher"]["spec"]["replicas"] == 2


def test_components_with_consumer_names_keep_them_across_restarts() -> None:
    """The consumer name is ``<role>-<hostname>`` (blockq.wire.streams.default_consumer_name)
    or the worker's instance id: only a StatefulSet keeps a pod's name, and one name set for
    every replica (BLOCKQ_CONSUMER_NAME in the shared ConfigMap) would make replicas share
    and re-read each other's pending entries."""
    statefulsets = _named("StatefulSet")
    for name in ("blockq-predictor", "blockq-dispatcher", "blockq-worker"):
        assert name in statefulsets, f"{name}: its pods must keep their names (a StatefulSet)"
        (container,) = _containers(statefulsets[name])
        args = build_parser().parse_args(_expanded_args(statefulsets[name], container))
        assert "BLOCKQ_CONSUMER_NAME" not in _container_env(statefulsets[name], container)
        assert getattr(args, "consumer_name", None) is None
    assert not set(_named("Deployment")) & {"blockq-predictor", "blockq-dispatcher"}


# --- network policies ----------------------------------------------------------------------------

NAMESPACE_LABELS = {"kubernetes.io/metadata.name": "blockq"}


@dataclass(frozen=True)
class Peer:
    """One end of a connection: a pod (its labels and its namespace's) or, with ``labels``
    None, an address outside the cluster."""

    name: str
    labels: Mapping[str, str] | None
    namespace_labels: Mapping[str, str] = field(default_factory=lambda: dict(NAMESPACE_LABELS))

    @property
    def in_blockq(self) -> bool:
        return self.labels is not None and self.namespace_labels == NAMESPACE_LABELS


EXTERNAL = Peer("a client outside the cluster", None)
MONITORING = Peer("prometheus", {"app": "prometheus"}, {"kubernetes.io/metadata.name": "monitoring",
                                                        "blockq-monitoring": "true"})
OTHER_NAMESPACE = Peer("a look-alike pod of another namespace", {"app.kubernetes.io/part-of": "blockq"},
                       {"kubernetes.io/metadata.name": "default"})
STRAY = Peer("an unlabelled pod of the namespace", {"app": "debug"})
KUBE_DNS = Peer("kube-dns", {"k8s-app": "kube-dns"}, {"kubernetes.io/metadata.name": "kube-system"})
OUTSIDERS = (EXTERNAL, MONITORING, OTHER_NAMESPACE, STRAY)


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"the check reads matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(rule_peer: Mapping[str, Any], peer: Peer) -> bool:
    assert "ipBlock" not in rule_peer, "the check does not read ipBlock"
    if peer.labels is None:
        return False
    namespace_selector = rule_peer.get("namespaceSelector")
    if namespace_selector is None:  # a podSelector alone: pods of the policy's namespace
        return peer.in_blockq and _selects(rule_peer["podSelector"], peer.labels)
    return (_selects(namespace_selector, peer.namespace_labels)
            and _selects(rule_peer.get("podSelector", {}), peer.labels))


def _direction_allows(policies: list[dict[str, Any]], pod: Peer, direction: str, other: Peer,
                      port: int, protocol: str) -> bool:
    """Whether ``pod``'s policies of ``direction`` (Ingress / Egress) let ``other`` through
    on ``port``: a pod no policy selects is open; one that some select is open to what one
    of their rules allows."""
    assert pod.labels is not None
    selecting = [p["spec"] for p in policies if direction in p["spec"]["policyTypes"]
                 and _selects(p["spec"]["podSelector"], pod.labels)]
    for rule in (r for spec in selecting for r in spec.get(direction.lower(), [])):
        peers = rule.get("from" if direction == "Ingress" else "to")
        ports = rule.get("ports")
        assert all(isinstance(p["port"], int) for p in ports or []), "numeric ports: every plugin reads them"
        if (not peers or any(_peer_matches(p, other) for p in peers)) and \
                (not ports or any((p["port"], p.get("protocol", "TCP")) == (port, protocol) for p in ports)):
            return True
    return not selecting


def _allowed(policies: list[dict[str, Any]], source: Peer, target: Peer, port: int, protocol: str = "TCP") -> bool:
    return ((not source.in_blockq or _direction_allows(policies, source, "Egress", target, port, protocol))
            and (not target.in_blockq or _direction_allows(policies, target, "Ingress", source, port, protocol)))


def _pods() -> dict[str, Peer]:
    return {w["metadata"]["name"]: Peer(w["metadata"]["name"], w["spec"]["template"]["metadata"]["labels"])
            for w in _workloads()}


def _expected_connections() -> list[tuple[Peer, Peer, int, str, bool]]:
    """(source, target, port, protocol, allowed): the pipeline's own traffic, and what else
    must be refused. The ports are the containers' own, read from the workloads."""
    pods, workloads = _pods(), {w["metadata"]["name"]: w for w in _workloads()}

    def port(workload: str, name: str) -> int:
        return next(_container_port(c, name) for c in _containers(workloads[workload])
                    if name in [p["name"] for p in c.get("ports", [])])

    redis, predictor, gateway = pods["blockq-redis"], pods["blockq-predictor"], pods["blockq-gateway"]
    redis_ports = [port("blockq-redis", "redis"), port("blockq-redis", "sentinel")]
    http = port("blockq-predictor", "http")
    expected = [(pod, redis, p, "TCP", True) for pod in pods.values() for p in redis_ports]
    expected += [(pod, predictor, http, "TCP", True) for pod in pods.values()]
    expected += [(pod, KUBE_DNS, 53, protocol, True) for pod in pods.values() for protocol in ("UDP", "TCP")]
    expected += [(pod, EXTERNAL, 443, "TCP", False) for pod in pods.values()]  # egress denied by default
    expected += [(peer, redis, p, "TCP", False) for peer in OUTSIDERS for p in redis_ports]
    expected += [(peer, predictor, http, "TCP", False) for peer in OUTSIDERS]
    expected += [(peer, gateway, port("blockq-gateway", "http"), "TCP", True)
                 for peer in (EXTERNAL, MONITORING, OTHER_NAMESPACE)]
    # What else runs in the namespace is closed both ways (default deny).
    expected += [(EXTERNAL, STRAY, 8080, "TCP", False), (STRAY, gateway, port("blockq-gateway", "http"), "TCP", False)]
    for name in ("blockq-predictor", "blockq-dispatcher", "blockq-worker"):
        metrics = port(name, "metrics")
        expected += [(MONITORING, pods[name], metrics, "TCP", True)]
        expected += [(peer, pods[name], metrics, "TCP", False) for peer in (EXTERNAL, OTHER_NAMESPACE, STRAY, gateway)]
    return expected


def _policy_mismatches(policies: list[dict[str, Any]]) -> list[str]:
    return [f"{s.name} -> {t.name}:{port}/{protocol} should be {'allowed' if ok else 'refused'}"
            for s, t, port, protocol, ok in _expected_connections() if _allowed(policies, s, t, port, protocol) != ok]


def test_network_policies_allow_the_pipelines_traffic_and_nothing_else() -> None:
    policies = [d for _, d in DOCUMENTS if d["kind"] == "NetworkPolicy"]
    assert _policy_mismatches(policies) == []
    default_deny = [p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]
                    and "egress" not in p["spec"]]
    assert default_deny and set(default_deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}


@pytest.mark.parametrize("removed", sorted(_named("NetworkPolicy")))
def test_every_network_policy_is_needed(removed: str) -> None:
    policies = [d for _, d in DOCUMENTS if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] != removed]
    assert _policy_mismatches(policies), f"removing {removed} changes nothing the checks see"
    assert _policy_mismatches([]), "with no policy at all everything is open"
