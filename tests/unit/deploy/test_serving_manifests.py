"""deploy/k8s/serving.yaml: the blue/green serving shape on Kubernetes, checked as the Helm values are (no cluster
here): one Deployment per colour that differ only in their colour (and the checkpoint and replica count a switch
changes), a Service that selects exactly one colour, engines that serve the stable model name on the pod's loopback
behind the project's key proxy (the pod's one port), become ready only when they answer, and leave the Service
before they stop; the key a file mounted into the proxy alone; and agreement with deploy/helm/values.yaml (image,
volume, GPU pool) and configs/promotion.yaml (the model name)."""

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


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["containers"]}


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("colour", COLOURS)
def test_the_engine_serves_the_stable_name_on_loopback_behind_the_key_proxy(colour: str) -> None:
    """vLLM binds the pod's loopback (only the pod's containers share it) and opens no port of the pod; the key
    proxy, the pod's one port and the Service's target, forwards to it; both ready only when they answer."""
    docs = load()
    pod = deployments(docs)[colour]["spec"]["template"]["spec"]
    assert set(containers(pod)) == {"engine", "endpoint"} and not pod.get("hostNetwork")
    engine, proxy = containers(pod)["engine"], containers(pod)["endpoint"]
    command = engine["command"]
    assert command[:2] == ["vllm", "serve"] and command[2] == "$(NEXA_CHECKPOINT)"
    assert "NEXA_CHECKPOINT" in {e["name"] for e in engine["env"]}  # $(VAR) is expanded by the kubelet
    assert _option(command, "--served-model-name") == load_policy().registered_model
    assert _option(command, "--host") == "127.0.0.1" and "ports" not in engine
    upstream = f"127.0.0.1:{_option(command, '--port')}"
    for probe in (engine["readinessProbe"], engine["livenessProbe"]):  # in the container: the pod's loopback
        assert f"http://{upstream}/health" in probe["exec"]["command"][-1]
    assert proxy["command"][:4] == ["python", "-m", "nexa_dagster.cli", "key-proxy"]
    assert _option(proxy["command"], "--upstream") == upstream
    [named] = proxy["ports"]
    assert named["containerPort"] == int(_option(proxy["command"], "--port"))
    assert proxy["readinessProbe"]["tcpSocket"] == {"port": named["name"]}
    [svc_port] = service(docs)["spec"]["ports"]
    assert svc_port["targetPort"] == named["name"]
    for c in (engine, proxy):  # both leave the Service's endpoints before SIGTERM
        sleep = c["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and int(sleep[1]) < pod["terminationGracePeriodSeconds"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1 and "resources" not in proxy
    from nexa_dagster.cli import main

    with pytest.raises(SystemExit):  # the command the proxy runs exists with these options
        main(["key-proxy", "--help"])


@pytest.mark.parametrize("colour", COLOURS)
def test_the_key_is_a_file_mounted_into_the_proxy_alone(colour: str) -> None:
    """The key proxy reads the Secret as a file (NEXA_SERVING_API_KEY_FILE); no container gets a secret in its
    environment (/proc/<pid>/environ), the engine mounts none, and no container gets a Kubernetes API token."""
    pod = deployments(load())[colour]["spec"]["template"]["spec"]
    engine, proxy = containers(pod)["engine"], containers(pod)["endpoint"]
    for c in (engine, proxy):
        assert not [e for e in c.get("env", []) if "valueFrom" in e], c["name"]
    assert not [e for e in engine["env"] if "KEY" in e["name"] or "TOKEN" in e["name"]]
    [key_file] = [e["value"] for e in proxy["env"] if e["name"] == "NEXA_SERVING_API_KEY_FILE"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [m for m in proxy["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert mount["readOnly"] and key_file == f"{mount['mountPath']}/api-key"
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == "nexa-serving" and secret["defaultMode"] & 0o077 == 0  # 0400
    assert not [m for m in engine["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert pod["automountServiceAccountToken"] is False
    context = pod["securityContext"]  # the image's user reads the file by fsGroup, as its own group
    assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == 1000


def test_the_manifests_agree_with_the_helm_values() -> None:
    values = yaml.safe_load((REPO_ROOT / "deploy/helm/values.yaml").read_text())
    cluster = values["nexaPipelineOverrides"]["gpu_cluster"]
    for d in deployments(load()).values():
        pod = d["spec"]["template"]["spec"]
        assert {c["image"] for c in pod["containers"]} == {cluster["k8s_image"]}
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == cluster["k8s_data_pvc"]
        assert containers(pod)["engine"]["volumeMounts"][0]["mountPath"] == cluster["k8s_data_mount"]
        assert pod["nodeSelector"] == cluster["k8s_node_selector"]
        assert pod["tolerations"] == cluster["k8s_tolerations"]
