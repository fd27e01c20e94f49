"""deploy/k8s validates offline: Kubernetes kinds against the Kubernetes schemas
(kubernetes-validate, strict), KEDA's ScaledObject against tests/k8s/scaledobject.schema.json,
plus the promises the manifests make to tokenyard (drain fits the grace period, AOF on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tokenyard.fleet.supervisor import AutoscaleMetrics

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.30"


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(ROOT.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append(
                    (f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata']['name']}", doc)
                )
    return out


DOCS = documents()
BY_KIND: dict[str, list[dict[str, Any]]] = {}
for _, _doc in DOCS:
    BY_KIND.setdefault(_doc["kind"], []).append(_doc)


def test_the_expected_pieces_are_there() -> None:
    assert {
        "Deployment",
        "Service",
        "StatefulSet",
        "ScaledObject",
        "HorizontalPodAutoscaler",
    } <= set(BY_KIND)


@pytest.mark.parametrize(("name", "doc"), [d for d in DOCS if d[1]["kind"] != "ScaledObject"])
def test_kubernetes_objects_validate_strictly(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_scaled_object_validates_against_its_crd_schema() -> None:
    schema = json.loads((Path(__file__).parent / "scaledobject.schema.json").read_text())
    for so in BY_KIND["ScaledObject"]:
        jsonschema.validate(so, schema)
        # the HPA behaviour KEDA passes through is Kubernetes' own type: check it as one
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
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


def test_a_misspelt_field_is_caught() -> None:
    schema = json.loads((Path(__file__).parent / "scaledobject.schema.json").read_text())
    so = dict(BY_KIND["ScaledObject"][0])
    so["spec"] = {**so["spec"], "maxReplicas": 3}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(so, schema)
    deployment = json.loads(json.dumps(BY_KIND["Deployment"][0]))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def test_workers_drain_within_their_grace_period_and_report_readiness() -> None:
    workers = [d for d in BY_KIND["Deployment"] if "worker" in d["metadata"]["name"]]
    assert workers
    for deployment in workers:
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        drain = float(_env(container)["TOKENYARD_WORKER_DRAIN_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] >= drain + 15
        assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
        assert container["readinessProbe"]["exec"]["command"][-1] == "worker-ready"


def test_autoscalers_target_the_worker_deployment_on_the_exported_gauge() -> None:
    names = {d["metadata"]["name"] for d in BY_KIND["Deployment"]}
    exported = {m.name for m in AutoscaleMetrics().registry.collect()}
    assert "tokenyard_desired_workers" in exported
    for so in BY_KIND["ScaledObject"]:
        assert so["spec"]["scaleTargetRef"]["name"] in names
        assert "tokenyard_desired_workers" in so["spec"]["triggers"][0]["metadata"]["query"]
    for hpa in BY_KIND["HorizontalPodAutoscaler"]:
        assert hpa["spec"]["scaleTargetRef"]["name"] in names
        assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] in exported


def test_valkey_keeps_an_append_only_file_on_a_volume() -> None:
    [valkey] = BY_KIND["StatefulSet"]
    [container] = valkey["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert valkey["spec"]["volumeClaimTemplates"]
