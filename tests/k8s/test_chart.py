"""The Helm chart (deploy/helm/tokenyard) rendered for several values, like `helm template`
(tests/k8s/helm_render.py: no registry here ships helm), validated strictly, and held to the
promises deploy/k8s keeps (tests/k8s/promises.py) plus the chart's own wiring."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from tests.k8s import promises
from tests.k8s.helm_render import Rendered, TemplateError, template
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.fleet.autoscale import AutoscaleConfig
from tokenyard.gateway.settings import GatewaySettings

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tokenyard"

CASES: dict[str, dict[str, Any]] = {
    "default": {},  # embedded Valkey, KEDA, no model volume, scrape annotations
    "external-broker-hpa": {
        "broker": {"mode": "external", "url": "redis://queue.example:6379/0"},
        "autoscaling": {"mode": "hpa"},
    },
    "external-secret-none": {
        "broker": {"mode": "external", "existingSecret": "tokenyard-broker"},
        "autoscaling": {"mode": "none"},
        "metrics": {"annotations": False},
    },
    "keda-pvc-admin-key-servicemonitor": {
        "modelVolume": {"type": "pvc", "storageClassName": "nfs"},
        "workers": [
            {
                "name": "qwen",
                "model": "/models/Qwen2.5-0.5B-Instruct",
                "engine": "vllm",
                "replicas": 2,
                "drainTimeoutS": 120,
                "env": {"TOKENYARD_WORKER_DEVICE": "cuda"},
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "nodeSelector": {"nvidia.com/gpu.present": "true"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            },
            {"name": "tiny", "model": "tiny", "engine": "hf", "replicas": 1, "drainTimeoutS": 30},
        ],
        "metrics": {"adminKey": {"value": "sk-admin"}, "serviceMonitor": {"enabled": True}},
        "autoscaling": {"minReplicas": 0},
    },
    "hostpath-existing-secret-amqp": {
        "broker": {
            "mode": "external",
            "url": "amqp://tokenyard:pw@rabbit:5672/",
            "tablesUrl": "redis://tables:6379/0",
        },
        "modelVolume": {"type": "hostPath", "hostPath": "/srv/models"},
        "metrics": {
            "adminKey": {"existingSecret": "ops-key", "bootstrap": False},
            "serviceMonitor": {"enabled": True},
        },
        "gateway": {"filesClaim": "tokenyard-files", "env": {"TOKENYARD_GATEWAY_QUEUE_SLO_S": 10}},
    },
}
RENDERED = {name: template(CHART, values, release="prod") for name, values in CASES.items()}
OBJECTS = [
    pytest.param(doc, id=f"{case}:{doc['kind']}/{doc['metadata']['name']}")
    for case, out in RENDERED.items()
    for doc in out.manifests
]
KNOWN_SETTINGS = {
    f"TOKENYARD_{section}_{f.name.upper()}"
    for kind, section in [
        (BrokerSettings, "BROKER"),
        (WorkerSettings, "WORKER"),
        (GatewaySettings, "GATEWAY"),
        (AutoscaleConfig, "AUTOSCALE"),
    ]
    for f in msgspec.structs.fields(kind)
}


def pods(out: Rendered) -> list[dict[str, Any]]:
    return [
        d["spec"]["template"] for d in out.manifests if d["kind"] in ("Deployment", "StatefulSet")
    ]


@pytest.mark.parametrize("doc", OBJECTS)
def test_every_object_validates_strictly(doc: dict[str, Any]) -> None:
    promises.validate(doc)


@pytest.mark.parametrize("case", list(CASES))
def test_the_promises_of_deploy_k8s_hold(case: str) -> None:
    docs = RENDERED[case].manifests
    promises.check_workers_drain_within_their_grace_period(docs)
    promises.check_autoscalers_target_workers_on_the_exported_gauge(docs)
    if CASES[case].get("broker", {}).get("mode") == "external":
        assert not promises.by_kind(docs).get("StatefulSet")
    else:
        promises.check_valkey_keeps_an_append_only_file_on_a_volume(docs)


@pytest.mark.parametrize("case", list(CASES))
def test_services_select_pods_and_ports_exist(case: str) -> None:
    out = RENDERED[case]
    templates = pods(out)
    for svc in out.of_kind("Service"):
        selector = svc["spec"]["selector"]
        [pod] = [p for p in templates if selector.items() <= p["metadata"]["labels"].items()]
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    for deployment in out.of_kind("Deployment") + out.of_kind("StatefulSet"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("case", list(CASES))
def test_containers_get_real_settings_and_one_broker(case: str) -> None:
    out = RENDERED[case]
    for pod in pods(out):
        mounts = {v["name"] for v in pod["spec"].get("volumes", [])}
        for container in pod["spec"]["containers"]:
            if container["name"] == "valkey":
                continue
            names = [e["name"] for e in container["env"]]
            assert len(names) == len(set(names))
            assert set(names) <= KNOWN_SETTINGS, set(names) - KNOWN_SETTINGS
            assert "TOKENYARD_BROKER_URL" in names
            assert container["args"][0] in ("gateway", "worker", "autoscale")
            assert {m["name"] for m in container.get("volumeMounts", [])} <= mounts
    broker = CASES[case].get("broker", {})
    [gateway] = [
        d for d in out.of_kind("Deployment") if d["metadata"]["name"] == "prod-tokenyard-gateway"
    ]
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    url = {e["name"]: e for e in container["env"]}["TOKENYARD_BROKER_URL"]
    if broker.get("existingSecret"):
        assert url["valueFrom"]["secretKeyRef"] == {"name": broker["existingSecret"], "key": "url"}
    elif broker.get("url"):
        assert url["value"] == broker["url"]
    else:
        # the embedded Valkey's pod, through its headless Service
        [valkey] = out.of_kind("StatefulSet")
        host = f"{valkey['metadata']['name']}-0.{valkey['spec']['serviceName']}"
        assert url["value"] == f"redis://{host}:6379/0"
        out.named("Service", valkey["spec"]["serviceName"])


@pytest.mark.parametrize("case", list(CASES))
def test_gateway_serves_every_worker_model_and_mounts_their_volume(case: str) -> None:
    out = RENDERED[case]
    gateway = out.named("Deployment", "prod-tokenyard-gateway")
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    served = promises.env(container)["TOKENYARD_GATEWAY_MODELS"].split(",")
    models = [
        promises.env(w["spec"]["template"]["spec"]["containers"][0])["TOKENYARD_WORKER_MODEL"]
        for w in promises.workers(out.manifests)
    ]
    assert sorted(served) == sorted(models)
    volume = CASES[case].get("modelVolume", {}).get("type", "none")
    for pod in [gateway["spec"]["template"]] + [
        w["spec"]["template"] for w in promises.workers(out.manifests)
    ]:
        mounts = {
            m["mountPath"]: m for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])
        }
        assert ("/models" in mounts) == (volume != "none")
        if volume != "none":
            assert mounts["/models"]["readOnly"]
    if volume == "pvc":
        claim = out.named("PersistentVolumeClaim", "prod-tokenyard-models")
        assert claim["spec"]["storageClassName"] == "nfs"


def test_autoscaling_modes_render_their_objects() -> None:
    def kinds(case: str) -> set[str]:
        return {d["kind"] for d in RENDERED[case].manifests}

    assert {"ScaledObject", "Deployment"} <= kinds("default")
    assert "HorizontalPodAutoscaler" not in kinds("default")
    assert "HorizontalPodAutoscaler" in kinds("external-broker-hpa")
    assert "ScaledObject" not in kinds("external-broker-hpa")
    none = RENDERED["external-secret-none"]
    # the count is the autoscaler's when there is one: an upgrade leaves it alone
    assert [w["spec"]["replicas"] for w in promises.workers(none.manifests)] == [1]
    assert all("replicas" not in w["spec"] for w in promises.workers(RENDERED["default"].manifests))
    assert not {"ScaledObject", "HorizontalPodAutoscaler"} & kinds("external-secret-none")
    assert not [d for d in none.of_kind("Deployment") if "autoscale" in d["metadata"]["name"]]
    # KEDA with minReplicas 0 scales to zero; the autoscaler sizes both models
    scaled = RENDERED["keda-pvc-admin-key-servicemonitor"]
    assert {so["spec"]["minReplicaCount"] for so in scaled.of_kind("ScaledObject")} == {0}
    queries = [
        so["spec"]["triggers"][0]["metadata"]["query"] for so in scaled.of_kind("ScaledObject")
    ]
    assert 'max(tokenyard_desired_workers{model="/models/Qwen2.5-0.5B-Instruct"})' in queries
    autoscale = scaled.named("Deployment", "prod-tokenyard-autoscale")
    args = autoscale["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--model"] == [
        "/models/Qwen2.5-0.5B-Instruct",
        "tiny",
    ]


def test_metrics_are_scraped_with_the_admin_key() -> None:
    out = RENDERED["keda-pvc-admin-key-servicemonitor"]
    secret = out.named("Secret", "prod-tokenyard-admin-key")
    assert base64.b64decode(secret["data"]["admin-key"]).decode() == "sk-admin"
    # the bootstrap keys file makes the key an admin tenant's, as the gateway reads the file
    keys = json.loads(base64.b64decode(secret["data"]["api-keys.json"]))
    assert keys == {"sk-admin": {"tenant": "ops", "admin": True}}
    gateway = out.named("Deployment", "prod-tokenyard-gateway")
    spec = gateway["spec"]["template"]["spec"]
    keys_file = promises.env(spec["containers"][0])["TOKENYARD_GATEWAY_API_KEYS_FILE"]
    [mount] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "keys"]
    assert keys_file == f"{mount['mountPath']}/api-keys.json"
    monitor = out.named("ServiceMonitor", "prod-tokenyard-gateway")
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {
        "name": "prod-tokenyard-admin-key",
        "key": "admin-key",
    }
    assert out.named("PodMonitor", "prod-tokenyard-workers")
    # an existing Secret, keys created in the broker: no bootstrap file, the Secret still used
    other = RENDERED["hostpath-existing-secret-amqp"]
    assert not other.of_kind("Secret")
    gateway = other.named("Deployment", "prod-tokenyard-gateway")
    assert "TOKENYARD_GATEWAY_API_KEYS_FILE" not in promises.env(
        gateway["spec"]["template"]["spec"]["containers"][0]
    )
    [endpoint] = other.named("ServiceMonitor", "prod-tokenyard-gateway")["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"]["name"] == "ops-key"
    # annotations for Prometheus' own discovery, on by default; the NOTES say the key is needed
    default = RENDERED["default"].named("Deployment", "prod-tokenyard-gateway")
    assert default["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "admin key" in out.notes and "docs/operations.md" in RENDERED["default"].notes


def test_pods_run_as_non_root() -> None:
    for out in RENDERED.values():
        for pod in pods(out):
            if pod["metadata"]["labels"]["app.kubernetes.io/name"] == "valkey":
                continue  # the Valkey image drops to its own user
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            for container in pod["spec"]["containers"]:
                assert container["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"broker": {"mode": "external"}}, "broker.url or broker.existingSecret"),
        ({"modelVolume": {"type": "hostPath"}}, "modelVolume.hostPath"),
        (
            {
                "autoscaling": {"mode": "hpa"},
                "workers": [
                    {
                        "name": "q",
                        "model": "/models/q",
                        "engine": "hf",
                        "replicas": 1,
                        "drainTimeoutS": 5,
                    }
                ],
            },
            "no valid label value",
        ),
    ],
)
def test_values_that_cannot_work_fail_the_render_with_a_reason(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(TemplateError, match=re.escape(message)):
        template(CHART, values)


@pytest.mark.parametrize(
    "values",
    [
        {"autoscaling": {"mode": "keda-ish"}},
        {"broker": {"mode": "embedded", "URL": "x"}},
        {
            "workers": [
                {
                    "name": "Tiny!",
                    "model": "tiny",
                    "engine": "hf",
                    "replicas": 1,
                    "drainTimeoutS": 5,
                }
            ]
        },
    ],
)
def test_values_schema_refuses_unknown_or_misspelt_values(values: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        template(CHART, values)


def test_release_names_prefix_every_object() -> None:
    out = template(CHART, release="tokenyard")
    assert {d["metadata"]["name"] for d in out.manifests} >= {
        "tokenyard-gateway",
        "tokenyard-valkey",
    }
    for d in RENDERED["default"].manifests:
        assert d["metadata"]["name"].startswith("prod-tokenyard-")
        assert d["metadata"]["labels"]["app.kubernetes.io/instance"] == "prod"
