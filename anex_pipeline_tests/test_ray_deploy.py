"""deploy/ray/, checked as far as it can be without Kubernetes: every pod template of the KubeRay
RayCluster validates as a Kubernetes Pod, the head takes no work, the workers have the GPUs and
the shared work volume, and deploy/ray/dagster.yaml is a valid Dagster instance config (test_ray.py
runs jobs on it against a real PostgreSQL server and a real Ray cluster)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config
from dagster_postgres import DagsterPostgresStorage

from anex_pipeline_tests.test_deploy import DEPLOY, GPU, load_yaml, pod, validate_k8s

RAY = DEPLOY / "ray"


def cluster() -> dict[str, Any]:
    return load_yaml(RAY / "raycluster.yaml")


def templates(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec["workerGroupSpecs"]]
    return [(name, group["template"]["spec"]) for name, group in groups]


@pytest.mark.parametrize("group", ["head", "gpu", "cpu"])
def test_each_pod_template_is_a_valid_pod(group: str) -> None:
    spec = dict(templates(cluster()["spec"]))[group]
    validate_k8s(pod(spec))


def test_a_broken_pod_template_is_refused() -> None:
    spec = dict(templates(cluster()["spec"]))["gpu"]
    spec["containers"][0]["resourcez"] = spec["containers"][0].pop("resources")
    with pytest.raises(Exception, match="resourcez"):
        validate_k8s(pod(spec))


def test_the_head_takes_no_work_and_the_workers_share_the_work_volume() -> None:
    doc = cluster()
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
