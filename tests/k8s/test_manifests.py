"""deploy/k8s validates offline: Kubernetes kinds against the Kubernetes schemas
(kubernetes-validate, strict), KEDA's ScaledObject against tests/k8s/scaledobject.schema.json,
plus the promises the manifests make to tokenyard (drain fits the grace period, AOF on);
tests/k8s/promises.py holds the checks, which the Helm chart's output passes too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.k8s import promises

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


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
ALL = [doc for _, doc in DOCS]
BY_KIND = promises.by_kind(ALL)


def test_the_expected_pieces_are_there() -> None:
    assert {
        "Deployment",
        "Service",
        "StatefulSet",
        "ScaledObject",
        "HorizontalPodAutoscaler",
    } <= set(BY_KIND)


@pytest.mark.parametrize(("name", "doc"), DOCS)
def test_objects_validate_strictly(name: str, doc: dict[str, Any]) -> None:
    promises.validate(doc)


def test_a_misspelt_field_is_caught() -> None:
    so = dict(BY_KIND["ScaledObject"][0])
    so["spec"] = {**so["spec"], "maxReplicas": 3}
    with pytest.raises(jsonschema.ValidationError):
        promises.validate(so)
    deployment = json.loads(json.dumps(BY_KIND["Deployment"][0]))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        promises.validate(deployment)


def test_workers_drain_within_their_grace_period_and_report_readiness() -> None:
    promises.check_workers_drain_within_their_grace_period(ALL)


def test_autoscalers_target_the_worker_deployment_on_the_exported_gauge() -> None:
    promises.check_autoscalers_target_workers_on_the_exported_gauge(ALL)


def test_valkey_keeps_an_append_only_file_on_a_volume() -> None:
    promises.check_valkey_keeps_an_append_only_file_on_a_volume(ALL)
