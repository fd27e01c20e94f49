"""What deploy/k8s and the Helm chart's output both promise tokenyard, checked on a list of
objects: Kubernetes kinds validate strictly, KEDA's and the Prometheus Operator's kinds against
their closed schemas, workers drain within their grace period, autoscalers target a worker
Deployment on the exported gauge, Valkey keeps an AOF on a volume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

from tokenyard.fleet.supervisor import AutoscaleMetrics

K8S_VERSION = "1.30"
HERE = Path(__file__).parent
SCALED_OBJECT = json.loads((HERE / "scaledobject.schema.json").read_text())
MONITORING = json.loads((HERE / "monitoring.schema.json").read_text())

Doc = dict[str, Any]


def by_kind(docs: list[Doc]) -> dict[str, list[Doc]]:
    out: dict[str, list[Doc]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def validate(doc: Doc) -> None:
    """Strictly, by kind: Kubernetes' own schemas, else the CRD's closed schema."""
    if doc["kind"] == "ScaledObject":
        jsonschema.validate(doc, SCALED_OBJECT)
        # the HPA behaviour KEDA passes through is Kubernetes' own type: check it as one
        behavior = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        hpa = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "probe"},
            "spec": {
                "scaleTargetRef": {"kind": "Deployment", "name": "x"},
                "maxReplicas": 2,
                "behavior": behavior,
            },
        }
        kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    elif doc["apiVersion"] == "monitoring.coreos.com/v1":
        jsonschema.validate(doc, MONITORING)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def env(container: Doc) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def workers(docs: list[Doc]) -> list[Doc]:
    return [
        d
        for d in docs
        if d["kind"] == "Deployment"
        and d["metadata"]["labels"].get("app.kubernetes.io/name") == "tokenyard-worker"
    ]


def check_workers_drain_within_their_grace_period(docs: list[Doc]) -> None:
    assert workers(docs)
    for deployment in workers(docs):
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        drain = float(env(container)["TOKENYARD_WORKER_DRAIN_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] >= drain + 15
        assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
        assert container["readinessProbe"]["exec"]["command"][-1] == "worker-ready"


def check_autoscalers_target_workers_on_the_exported_gauge(docs: list[Doc]) -> None:
    kinds = by_kind(docs)
    names = {d["metadata"]["name"] for d in workers(docs)}
    exported = {m.name for m in AutoscaleMetrics().registry.collect()}
    assert "tokenyard_desired_workers" in exported
    for so in kinds.get("ScaledObject", []):
        assert so["spec"]["scaleTargetRef"]["name"] in names
        assert "tokenyard_desired_workers" in so["spec"]["triggers"][0]["metadata"]["query"]
    for hpa in kinds.get("HorizontalPodAutoscaler", []):
        assert hpa["spec"]["scaleTargetRef"]["name"] in names
        assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] in exported


def check_valkey_keeps_an_append_only_file_on_a_volume(docs: list[Doc]) -> None:
    [valkey] = by_kind(docs)["StatefulSet"]
    [container] = valkey["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    mounted = {m["name"] for m in container["volumeMounts"]}
    assert mounted & {c["metadata"]["name"] for c in valkey["spec"]["volumeClaimTemplates"]}
