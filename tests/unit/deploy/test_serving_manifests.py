"""deploy/k8s/serving.yaml: the blue/green serving shape on Kubernetes, checked as the Helm values are (no cluster
here): one Deployment per colour that differ only in their colour (and the checkpoint and replica count a switch
changes), a Service that selects exactly one colour, engines that serve the stable model name, become ready only
when they answer, and leave the Service before they stop; and agreement with deploy/helm/values.yaml (image, volume,
GPU pool) and configs/promotion.yaml (the model name)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.evaluation.promotion import load_policy

MANIFESTS = REPO_ROOT / "deploy/k8s/serving.yaml"
COLOURS = ("blue", "green")


def load() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d]


def deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["labels"]["colour"]: d for d in docs if d["kind"] == "Deployment"}


def service(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [svc] = [d for d in docs if d["kind"] == "Service"]
    return svc


def served_colours(docs: list[dict[str, Any]]) -> list[str]:
    """The colours whose pods the Service's selector matches (a label selector: every key must match)."""
    selector = service(docs)["spec"]["selector"]
    return [
        c
        for c, d in deployments(docs).items()
        if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())
    ]


def without_colour(deployment: dict[str, Any]) -> dict[str, Any]:
    """The Deployment with what a switch may differ in (name, colour, replicas, checkpoint) blanked."""
    d = copy.deepcopy(deployment)
    colour = d["metadata"]["labels"]["colour"]
    d["metadata"]["name"] = d["metadata"]["name"].removesuffix(colour)
    for labels in (
        d["metadata"]["labels"],
        d["spec"]["selector"]["matchLabels"],
        d["spec"]["template"]["metadata"]["labels"],
    ):
        labels["colour"] = "*"
    d["spec"]["replicas"] = "*"
    for c in d["spec"]["template"]["spec"]["containers"]:
        c["env"] = [e for e in c["env"] if e["name"] != "NEXA_CHECKPOINT"]
    return d


def test_one_deployment_per_colour_differing_only_in_colour() -> None:
    docs = load()
    assert set(deployments(docs)) == set(COLOURS)
    blue, green = (without_colour(deployments(docs)[c]) for c in COLOURS)
    assert blue == green
    for colour, d in deployments(docs).items():
        assert d["metadata"]["name"] == f"nexa-serving-{colour}"
        assert d["spec"]["selector"]["matchLabels"] == d["spec"]["template"]["metadata"]["labels"]


def test_the_service_sends_traffic_to_exactly_one_running_colour() -> None:
    docs = load()
    assert served_colours(docs) == ["blue"] and deployments(docs)["blue"]["spec"]["replicas"] >= 1
    switched = copy.deepcopy(docs)
    service(switched)["spec"]["selector"]["colour"] = "green"  # serving.yaml's switch patches this
    assert served_colours(switched) == ["green"]
    del service(switched)["spec"]["selector"][
        "colour"
    ]  # a selector without the colour: both would get traffic
    assert served_colours(switched) == list(COLOURS)


@pytest.mark.parametrize("colour", COLOURS)
def test_the_engine_serves_the_stable_name_and_is_ready_only_when_it_answers(colour: str) -> None:
    docs = load()
    pod = deployments(docs)[colour]["spec"]["template"]["spec"]
    [engine] = pod["containers"]
    command = engine["command"]
    assert command[:2] == ["vllm", "serve"] and command[2] == "$(NEXA_CHECKPOINT)"
    assert "NEXA_CHECKPOINT" in {e["name"] for e in engine["env"]}  # $(VAR) is expanded by the kubelet
    assert command[command.index("--served-model-name") + 1] == load_policy().registered_model
    port = int(command[command.index("--port") + 1])
    [named] = engine["ports"]
    assert named["containerPort"] == port
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": named["name"]}
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    sleep = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) < pod["terminationGracePeriodSeconds"]
    [svc_port] = service(docs)["spec"]["ports"]
    assert svc_port["targetPort"] == named["name"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_manifests_agree_with_the_helm_values() -> None:
    values = yaml.safe_load((REPO_ROOT / "deploy/helm/values.yaml").read_text())
    cluster = values["nexaPipelineOverrides"]["gpu_cluster"]
    for d in deployments(load()).values():
        pod = d["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == cluster["k8s_image"]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == cluster["k8s_data_pvc"]
        assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == cluster["k8s_data_mount"]
        assert pod["nodeSelector"] == cluster["k8s_node_selector"]
        assert pod["tolerations"] == cluster["k8s_tolerations"]


@pytest.mark.parametrize("colour", COLOURS)
def test_the_engine_wants_an_api_key_from_a_secret(colour: str) -> None:
    [engine] = deployments(load())[colour]["spec"]["template"]["spec"]["containers"]
    [key] = [
        e for e in engine["env"] if e["name"] == "VLLM_API_KEY"
    ]  # what `vllm serve --api-key` defaults to
    assert "value" not in key and key["valueFrom"]["secretKeyRef"] == {
        "name": "nexa-serving",
        "key": "api-key",
    }
