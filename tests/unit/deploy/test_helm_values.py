"""deploy/helm/values.yaml: valid for Dagster's Helm chart, and in agreement with the rest of the repo.

There is no cluster and no `helm` here. What is checked instead:

* the values against the chart's own values.schema.json, vendored (see SCHEMA_SOURCE), the way `helm install`
  checks them: Helm merges the values over the chart's values.yaml before validating, so a key those defaults
  provide is never missing, except inside a list (lists replace the chart's list, they are not merged);
* the instance settings the chart writes into dagster.yaml from these values equal configs/dagster/production.yaml's
  (run queue limits, pools, run monitoring, run retries, telemetry) and pass Dagster's own instance-config check;
* the code location runs the command and image the Dockerfile and docker-compose.yaml use, and the module exists;
* no literal secret: the PostgreSQL password and the API keys only come from Kubernetes secrets;
* the GPU pool: the deployment's environment plus the pipeline.yaml ConfigMap docs/operations.md builds give the
  kubernetes training backend a pod spec on the GPU nodes, with one `nvidia.com/gpu` per rank of the scale preset,
  on the volume the run pods write the job to;
* docs/operations.md creates every secret, volume claim and ConfigMap the values refer to.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import re
import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dagster as dg
import jsonschema
import pytest
import yaml

# private: the only check of a dagster.yaml against Dagster's schema that does not connect to its PostgreSQL
from dagster._core.instance.config import dagster_instance_config
from dagster_postgres.utils import pg_url_from_config
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from nexa_dagster.core.common.config import REPO_ROOT, load_scale
from nexa_dagster.core.training.job import TrainingJob

VALUES = REPO_ROOT / "deploy/helm/values.yaml"
SCHEMA = REPO_ROOT / "tests/data/dagster_chart_values.schema.json"
# Where the vendored schema comes from: helm/dagster/values.schema.json of github.com/dagster-io/dagster at this
# commit (the newest version the search index held: it has the `concurrency` and `ui` sections; the index could not
# tie a version to the 1.13.27 tag that .venv has). Not edited; the digest catches an accidental change.
SCHEMA_SOURCE = {
    "repository": "https://github.com/dagster-io/dagster",
    "path": "helm/dagster/values.schema.json",
    "commit": "2bdb239558bfe98dc2a89e2e0c2f3f849367fdd4",
    "sha256": "6d9aadb17881f23a96cdc0df89e3c4a5aa65e5b4a010b2eada443f6884c27ee1",
}
# Kubernetes' own object schemas, which the chart's schema references by URL, are not vendored.
KUBERNETES_SCHEMAS = "https://raw.githubusercontent.com/yannh/kubernetes-json-schema/"


def load_values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def production() -> dict[str, Any]:
    return yaml.safe_load((REPO_ROOT / "configs/dagster/production.yaml").read_text())


def the_deployment(values: dict[str, Any]) -> dict[str, Any]:
    deployments = values["dagster-user-deployments"]["deployments"]
    assert len(deployments) == 1, "one code location: nexa_dagster"
    return deployments[0]


# -- the chart's schema ------------------------------------------------------------------------------------------
def _kubernetes_stub(schema: dict[str, Any]) -> dict[str, Any]:
    """A document with an empty (accept-anything) schema at every pointer the chart's schema uses into Kubernetes'
    definitions: those objects are then checked only by the chart's own constraints (object or array)."""
    stub: dict[str, Any] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith(KUBERNETES_SCHEMAS):
                target = stub
                for part in ref.split("#", 1)[1].strip("/").split("/"):
                    target = target.setdefault(part, {})
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return stub


def _objects_in_lists(node: Any, in_list: bool = False, found: set[int] | None = None) -> set[int]:
    found = set() if found is None else found
    if isinstance(node, dict):
        if in_list:
            found.add(id(node))
        for value in node.values():
            _objects_in_lists(value, in_list, found)
    elif isinstance(node, list):
        for value in node:
            _objects_in_lists(value, True, found)
    return found


def chart_schema_errors(values: dict[str, Any]) -> list[str]:
    """Errors `helm install -f values.yaml` would report from the chart's schema (offline)."""
    schema = json.loads(SCHEMA.read_text())
    stub = Resource.from_contents(_kubernetes_stub(schema), default_specification=DRAFT202012)
    registry: Registry = Registry(retrieve=lambda uri: stub)
    in_lists = _objects_in_lists(values)

    def required(validator: Any, names: list[str], instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
        if (
            isinstance(instance, dict) and id(instance) in in_lists
        ):  # elsewhere the chart's defaults fill them in
            for name in names:
                if name not in instance:
                    yield jsonschema.ValidationError(f"{name!r} is a required property")

    validator_class = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"required": required})
    validator = validator_class(schema, registry=registry)
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(values)
    ]


def test_the_vendored_schema_is_the_charts() -> None:
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == SCHEMA_SOURCE["sha256"]
    schema = json.loads(SCHEMA.read_text())
    assert schema["title"] == "DagsterHelmValues"
    assert {"dagster-user-deployments", "runLauncher", "dagsterDaemon", "concurrency"} <= set(
        schema["properties"]
    )


def test_values_pass_the_charts_schema() -> None:
    assert chart_schema_errors(load_values()) == []


def test_the_schema_check_rejects_what_helm_would_reject() -> None:
    """The check above is not vacuous: a misspelt key, a missing field of a list item, an unknown launcher."""
    values = load_values()
    typo = copy.deepcopy(values)
    runs = typo["concurrency"]["runs"]
    runs["maxConcurentRuns"] = runs.pop("maxConcurrentRuns")
    assert any("maxConcurentRuns" in e for e in chart_schema_errors(typo))
    no_port = copy.deepcopy(values)
    del the_deployment(no_port)["port"]
    assert any("'port' is a required property" in e for e in chart_schema_errors(no_port))
    launcher = copy.deepcopy(values)
    launcher["runLauncher"]["type"] = "K8sLauncher"
    assert any(e.startswith("runLauncher.type") for e in chart_schema_errors(launcher))


# -- the instance: same settings as production.yaml -------------------------------------------------------------
def chart_instance_sections(values: dict[str, Any]) -> dict[str, Any]:
    """The dagster.yaml sections the chart writes from these values, for the keys production.yaml sets, as the
    chart's templates do (configmap-instance.yaml, helpers/instance/_run-coordinator.tpl, _concurrency.tpl and
    _postgresql.tpl): camelCase values become the instance's snake_case keys, additionalInstanceConfig is appended."""
    daemon = values["dagsterDaemon"]
    coordinator = daemon["runCoordinator"]
    assert coordinator["enabled"] and coordinator["type"] == "QueuedRunCoordinator"
    queue = {
        snake: value
        for camel, snake in (
            ("maxConcurrentRuns", "max_concurrent_runs"),
            ("tagConcurrencyLimits", "tag_concurrency_limits"),
            ("dequeueIntervalSeconds", "dequeue_interval_seconds"),
        )
        if (value := coordinator.get("config", {}).get("queuedRunCoordinator", {}).get(camel))
    }
    monitoring = daemon["runMonitoring"]
    pg = values["postgresql"]
    postgres_db = {
        "username": pg["postgresqlUsername"],
        "password": {"env": "DAGSTER_PG_PASSWORD"},
        "hostname": pg["postgresqlHost"],
        "db_name": pg["postgresqlDatabase"],
        "port": pg["service"]["port"],
        "params": pg.get("postgresqlParams", {}),
        "scheme": pg["postgresqlScheme"],
    }
    storages = (
        ("run", "run_storage", "PostgresRunStorage"),
        ("event_log", "event_log", "PostgresEventLogStorage"),
        ("schedule", "schedule_storage", "PostgresScheduleStorage"),
    )
    sections: dict[str, Any] = {
        **{
            f"{kind}_storage": {
                "module": f"dagster_postgres.{module}",
                "class": cls,
                "config": {"postgres_db": postgres_db},
            }
            for kind, module, cls in storages
        },
        "run_coordinator": {
            "module": "dagster._core.run_coordinator",  # a string the chart writes, not an import
            "class": "QueuedRunCoordinator",
            **({"config": queue} if queue else {}),
        },
        "telemetry": {"enabled": values["telemetry"]["enabled"]},
    }
    concurrency = values.get("concurrency", {})
    if concurrency.get("enabled"):
        pools = {
            snake: value
            for camel, snake in (
                ("defaultLimit", "default_limit"),
                ("granularity", "granularity"),
                ("opGranularityRunBuffer", "op_granularity_run_buffer"),
            )
            if (value := concurrency.get("pools", {}).get(camel)) is not None
        }
        runs_values = concurrency.get("runs", {})
        runs: dict[str, Any] = {}
        if runs_values.get("maxConcurrentRuns") is not None:
            runs["max_concurrent_runs"] = runs_values["maxConcurrentRuns"]
        if runs_values.get("tagConcurrencyLimits"):
            runs["tag_concurrency_limits"] = [
                {"key": t["key"], **({"value": t["value"]} if t.get("value") else {}), "limit": t["limit"]}
                for t in runs_values["tagConcurrencyLimits"]
            ]
        # _concurrency.tpl fails the install when a limit is set both here and on the run coordinator
        assert not ({"max_concurrent_runs", "tag_concurrency_limits"} & set(queue) & set(runs))
        sections["concurrency"] = {**({"pools": pools} if pools else {}), **({"runs": runs} if runs else {})}
    if monitoring["enabled"]:  # the template writes these three fields only, and nothing when disabled
        sections["run_monitoring"] = {
            "enabled": True,
            "start_timeout_seconds": monitoring["startTimeoutSeconds"],
            "poll_interval_seconds": monitoring["pollIntervalSeconds"],
            **(
                {"max_resume_run_attempts": monitoring["maxResumeRunAttempts"]}
                if monitoring.get("maxResumeRunAttempts")
                else {}
            ),
        }
    if daemon["runRetries"]["enabled"]:
        sections["run_retries"] = {"enabled": True, "max_retries": daemon["runRetries"]["maxRetries"]}
    extra = values.get("additionalInstanceConfig") or {}
    assert not set(extra) & set(sections), "the chart would write these keys twice into dagster.yaml"
    return {**sections, **extra}


def test_the_instance_has_productions_queue_pools_monitoring_and_retries(tmp_path: Path) -> None:
    instance = chart_instance_sections(load_values())
    prod = production()
    assert instance["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert (
        instance["concurrency"] == prod["concurrency"]
    )  # max concurrent runs, the backfill tag limit, pools
    assert instance["run_monitoring"] == prod["run_monitoring"]
    assert instance["run_retries"] == prod["run_retries"]
    assert instance["telemetry"] == prod["telemetry"]
    # and Dagster (the version in this venv) accepts the whole of it: it refuses, for one, run limits set on the
    # run coordinator next to a `concurrency` section
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(instance))
    config = dagster_instance_config(str(tmp_path))[0]
    assert config["run_retries"]["retry_on_asset_or_op_failure"] is False
    assert (
        config["concurrency"]["runs"]["max_concurrent_runs"]
        == prod["concurrency"]["runs"]["max_concurrent_runs"]
    )


def test_the_database_url_names_the_same_driver_as_production() -> None:
    instance = chart_instance_sections(load_values())
    postgres_db = {**instance["run_storage"]["config"]["postgres_db"], "password": "from-the-secret"}
    url = pg_url_from_config({"postgres_db": postgres_db})
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    assert (
        urlsplit(url).scheme
        == urlsplit(compose["services"]["daemon"]["environment"]["DAGSTER_PG_URL"]).scheme
    )


# -- the code location: this project's image and module ----------------------------------------------------------
def dockerfile_lines() -> list[str]:
    return (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()


def built_images() -> set[str]:
    """name:tag of the images the Dockerfile documents how to build (`docker build -t ...` in its header)."""
    names = {m.group(1) for line in dockerfile_lines() for m in re.finditer(r"docker build -t (\S+)", line)}
    return {name if ":" in name else f"{name}:latest" for name in names}


def image_name(reference: str) -> str:
    """ghcr.io/nexa/nexa-dagster:gpu -> nexa-dagster:gpu (the registry is the deployer's)."""
    name = reference.rsplit("/", 1)[-1]
    return name if ":" in name else f"{name}:latest"


def test_the_code_location_runs_this_projects_image_and_module() -> None:
    deployment = the_deployment(load_values())
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    # the chart's container command for codeServerArgs (dagster-user-deployments/templates/deployment-user.yaml)
    command = [
        "dagster",
        "code-server",
        "start",
        "-h",
        "0.0.0.0",
        "-p",
        str(deployment["port"]),
        *deployment["codeServerArgs"],
    ]
    assert command == compose["services"]["user_code"]["command"]
    args = deployment["codeServerArgs"]
    module = args[args.index("-m") + 1]
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert module == pyproject["tool"]["dagster"]["module_name"]
    assert isinstance(importlib.import_module(module).defs, dg.Definitions)
    exposed = {port for line in dockerfile_lines() if line.startswith("EXPOSE") for port in line.split()[1:]}
    assert str(deployment["port"]) in exposed
    image = deployment["image"]
    assert image_name(f"{image['repository']}:{image['tag']}") in built_images()
    assert image_name(f"{image['repository']}:{image['tag']}") == compose["services"]["user_code"]["image"]
    # Kubernetes object names: the deployment's name becomes a Deployment and a Service name
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", deployment["name"])


def test_the_image_can_launch_training_pods_and_write_dagster_home() -> None:
    values = load_values()
    lines = dockerfile_lines()
    extras = next(line.split("=", 1)[1] for line in lines if line.startswith("ARG EXTRAS="))
    assert "k8s" in extras.split(","), "the run pod imports dagster_k8s.PipesK8sClient"
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    assert values["global"]["dagsterHome"] == compose["services"]["daemon"]["environment"]["DAGSTER_HOME"]
    workdir = [line.split()[1] for line in lines if line.startswith("WORKDIR")][-1]
    home = Path(values["global"]["dagsterHome"]).relative_to(workdir)
    assert any(line.startswith("RUN") and "mkdir -p" in line and f" {home} " in f"{line} " for line in lines)
    assert any(line.startswith("RUN") and f"chown -R nexa:nexa {workdir}" in line for line in lines)


# -- no literal secret -------------------------------------------------------------------------------------------
SECRET_KEY = re.compile(r"pass(word|wd)?|secret|token|api[-_]?key|credential|private[-_]?key", re.IGNORECASE)
SECRET_VALUE = [
    re.compile(r"://[^/\s:@]+:[^/\s@]+@"),  # a URL with user:password
    re.compile(r"\b(sk|pk|rk)-[A-Za-z0-9_-]{16,}"),  # OpenAI-style keys
    re.compile(r"\bhf_[A-Za-z0-9]{20,}|\bgh[pousr]_[A-Za-z0-9]{20,}|\bAKIA[0-9A-Z]{16}\b"),
    re.compile(r"^[A-Za-z0-9+/=_-]{32,}$"),  # a long opaque token
]


def literal_secrets(node: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Paths of values that look like a password or key written into the file (a secret's *name* is fine)."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            key = str(key)
            if (
                SECRET_KEY.search(key)
                and not key.lower().endswith("name")
                and isinstance(value, str | int)
                and not isinstance(value, bool)
                and str(value) != ""
            ):
                found.append(".".join((*path, key)))
            found += literal_secrets(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += literal_secrets(value, (*path, str(i)))
    elif isinstance(node, str) and any(p.search(node) for p in SECRET_VALUE):
        found.append(".".join(path))
    return found


def test_no_secret_is_written_in_the_values() -> None:
    values = load_values()
    # the detector finds what it is for
    planted = copy.deepcopy(values)
    planted["postgresql"]["postgresqlPassword"] = "hunter2"
    the_deployment(planted)["env"]["NEXA_TEACHER_API_KEY"] = "sk-0123456789abcdefghij"
    the_deployment(planted)["env"]["DAGSTER_PG_URL"] = "postgresql+psycopg2://dagster:hunter2@db:5432/dagster"
    assert len(literal_secrets(planted)) == 4  # the password, the key (by name and by value), the URL
    assert literal_secrets(values) == []
    # ... and the real ones come from secrets: the chart must not generate one from its default password
    assert values["generatePostgresqlPasswordSecret"] is False and values["global"]["postgresqlSecretName"]
    assert "postgresqlPassword" not in values["postgresql"]
    deployment = the_deployment(values)
    assert deployment["includeConfigInLaunchedRuns"]["enabled"], "run pods get the same secrets"
    assert deployment["envSecrets"], (
        "the API keys (NEXA_TEACHER_API_KEY, NEXA_JUDGE_API_KEY) come from a secret"
    )


def test_the_operations_page_creates_every_object_the_values_refer_to() -> None:
    values = load_values()
    deployment = the_deployment(values)
    names = {values["global"]["postgresqlSecretName"], *(s["name"] for s in deployment["envSecrets"])}
    for volume in deployment["volumes"]:
        names.add(
            volume["persistentVolumeClaim"]["claimName"]
            if "persistentVolumeClaim" in volume
            else volume["configMap"]["name"]
        )
    page = (REPO_ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    kubernetes = page[page.index("### Kubernetes") : page.index("### Docker")]
    assert "deploy/helm/values.yaml" in kubernetes
    assert [name for name in sorted(names) if name not in kubernetes] == []


# -- the GPU pool ------------------------------------------------------------------------------------------------
def test_training_pods_land_on_the_gpu_pool_with_a_gpu_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a run pod builds: the deployment's environment, configs/pipeline.yaml replaced by the ConfigMap (the
    pipeline config with nexaPipelineOverrides applied, as docs/operations.md's command does), then the training
    pod."""
    # imported before the environment changes: its module-level `defs` is shared with the other tests
    from nexa_dagster.definitions import build_resources

    values = load_values()
    deployment = the_deployment(values)
    overrides = values["nexaPipelineOverrides"]
    pipeline = {**yaml.safe_load((REPO_ROOT / "configs/pipeline.yaml").read_text()), **overrides}
    configs = shutil.copytree(
        REPO_ROOT / "configs", tmp_path / "configs"
    )  # the image's configs/, one file mounted over
    (configs / "pipeline.yaml").write_text(yaml.safe_dump(pipeline))
    monkeypatch.setenv("NEXA_CONFIG_DIR", str(configs))
    for name, value in deployment["env"].items():
        monkeypatch.setenv(name, value)
    cluster = build_resources()["gpu_cluster"]
    assert (cluster.backend, cluster.accelerator) == ("kubernetes", "cuda")
    assert (overrides["gpu_cluster"]["backend"], overrides["gpu_cluster"]["accelerator"]) == (
        deployment["env"]["NEXA_CLUSTER_BACKEND"],
        deployment["env"]["NEXA_ACCELERATOR"],
    )
    # one GPU per rank of the preset the deployment trains (no "ranks differ from the recipe" warning)
    assert cluster.num_procs == load_scale(deployment["env"]["NEXA_SCALE"]).training.num_procs

    work = Path(cluster.k8s_data_mount) / "runs" / "ckpt"
    spec = cluster.pod_spec(cluster.training_launch(TrainingJob.model_construct(run_id="ckpt"), work))
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(cluster.num_procs)
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert f"--nproc_per_node={cluster.num_procs}" in container["command"]
    assert spec["nodeSelector"] and spec["nodeSelector"] == cluster.k8s_node_selector
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
    for toleration in spec["tolerations"]:
        assert toleration["operator"] in ("Exists", "Equal")
        assert toleration["effect"] in ("NoSchedule", "PreferNoSchedule", "NoExecute")
    # nothing else asks for the GPU nodes: no other pod of the release tolerates their taint or wants a GPU
    chart_values = {key: value for key, value in values.items() if key != "nexaPipelineOverrides"}
    assert not re.search(r"tolerations|nodeSelector|nvidia\.com/gpu", json.dumps(chart_values))
    assert image_name(cluster.k8s_image) in built_images() and container["image"] == cluster.k8s_image

    # the training pod mounts the volume the run pod writes the job file to, at the same path
    mounts = {m["name"]: m for m in deployment["volumeMounts"]}
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in deployment["volumes"]
        if "persistentVolumeClaim" in v
    }
    (data_volume,) = [name for name in claims if mounts[name]["mountPath"] == cluster.k8s_data_mount]
    assert claims[data_volume] == cluster.k8s_data_pvc
    assert {"name": "data", "persistentVolumeClaim": {"claimName": cluster.k8s_data_pvc}} in spec["volumes"]
    assert Path(deployment["env"]["NEXA_DATA_ROOT"]).is_relative_to(cluster.k8s_data_mount)

    # the ConfigMap is mounted where the image reads configs/pipeline.yaml (WORKDIR of the Dockerfile's last stage)
    workdir = [line.split()[1] for line in dockerfile_lines() if line.startswith("WORKDIR")][-1]
    config_mounts = [m for m in deployment["volumeMounts"] if m.get("subPath") == "pipeline.yaml"]
    assert [m["mountPath"] for m in config_mounts] == [f"{workdir}/configs/pipeline.yaml"]
    assert (REPO_ROOT / "configs/pipeline.yaml").exists()
