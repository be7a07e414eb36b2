"""The deployment files are linted and validated with the tools made for them (hadolint, podman-compose and the
compose spec, kustomize and kubernetes-validate), and checked to agree with the server: the ports, the probes'
routes, the stop grace periods against the drain timeout, the metric the autoscaler reads, the user."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ferrum.config.loader import load_config
from ferrum.server.metrics import METRIC_NAMES
from tests.deploy.tools import ROOT, tool

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu"]
KUBE_VERSIONS = ["1.29.0", "1.37.0"]  # the oldest Kubernetes still commonly run, and kubernetes-validate's newest


def run(*cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=120)


# -- Dockerfiles -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "docker/Dockerfile.cuda"])
def test_dockerfile_passes_hadolint(dockerfile: str) -> None:
    res = run(tool("hadolint"), "--failure-threshold", "info", str(ROOT / dockerfile))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "docker/Dockerfile.cuda"])
def test_dockerfile_runs_as_the_documented_service(dockerfile: str) -> None:
    """What scripts/check_container_image.py asserts in `podman inspect` for the CPU image, read from the text
    for both (the CUDA image cannot be built here)."""
    text = (ROOT / dockerfile).read_text()
    final = text.rsplit("\nFROM ", 1)[1]  # the final stage
    assert re.search(r"^USER 10001:10001$", final, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", final, re.M)
    assert re.search(r"^EXPOSE 8000$", final, re.M)
    assert re.search(r"^VOLUME \[\"/var/cache/ferrum\"\]$", final, re.M)
    assert re.search(r"^HEALTHCHECK .*\n.*/ready", final, re.M)
    assert '["dumb-init", "--single-child", "--", "ferrum", "serve", "--config", "/etc/ferrum/config.yaml"]' in final
    assert re.search(r"^ARG BASE_IMAGE=", text, re.M) and "ARG TORCH_INDEX_URL" in text
    assert "AS build" in text and "COPY --from=build /opt/ferrum /opt/ferrum" in final


def test_cuda_image_pins_the_torch_the_gpu_figures_were_measured_with() -> None:
    text = (ROOT / "docker" / "Dockerfile.cuda").read_text()
    assert 'ARG TORCH_SPEC="torch==2.11.0"' in text and "whl/cu130" in text and "nvidia/cuda:13." in text


def test_image_config_is_a_valid_ferrum_config() -> None:
    config = load_config(ROOT / "docker" / "config.yaml", {}, environ={"FERRUM_MODEL": "/models/demo"})
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    assert str(config.weights.cache_dir) == "/var/cache/ferrum"


# -- compose -----------------------------------------------------------------------------------------------


def compose_config(*files: str, password: str | None = "secret") -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MINIO_ROOT_PASSWORD", "MODEL_NAME", "MODEL_DIR")}
    if password is not None:
        env["MINIO_ROOT_PASSWORD"] = password
    args = [a for f in files for a in ("-f", str(ROOT / "docker" / f))]
    return run(tool("podman-compose"), *args, "config", env=env)


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml")], ids=["cpu", "gpu"])
def test_compose_file_renders_and_follows_the_compose_spec(files: tuple[str, ...]) -> None:
    from compose_spec import PyCompose

    res = compose_config(*files)
    assert res.returncode == 0, res.stderr[-2000:]
    PyCompose.from_yaml(res.stdout)  # raises ValueError naming the field that breaks the spec
    doc = yaml.safe_load(res.stdout)
    ferrum, upload = doc["services"]["ferrum"], doc["services"]["upload-model"]
    env = ferrum["environment"]
    assert env["FERRUM_MODEL"].startswith("s3://models/") and env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert env["AWS_SECRET_ACCESS_KEY"] == "secret" == upload["environment"]["AWS_SECRET_ACCESS_KEY"]
    assert ferrum["depends_on"]["upload-model"]["condition"] == "service_completed_successfully"
    assert ferrum["read_only"] is True and "/tmp" in ferrum["tmpfs"]
    docker_config = load_config(ROOT / "docker" / "config.yaml", {}, environ={"FERRUM_MODEL": "/m"})
    drain = docker_config.server.lifecycle.shutdown_timeout_s
    assert int(ferrum["stop_grace_period"].rstrip("s")) > drain
    if "compose.gpu.yaml" in files:
        assert ferrum["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        devices = ferrum["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    else:
        assert ferrum["build"]["dockerfile"] == "Dockerfile"


def test_compose_refuses_to_start_without_the_store_password() -> None:
    res = compose_config("compose.yaml", password=None)
    assert res.returncode != 0 and "MINIO_ROOT_PASSWORD" in res.stderr


# -- Kubernetes --------------------------------------------------------------------------------------------


def kustomize_build(overlay: str) -> list[dict]:
    res = run(tool("kustomize"), "build", str(KUBE / "overlays" / overlay))
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_and_validates(overlay: str, version: str, tmp_path: Path) -> None:
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(yaml.safe_dump_all(kustomize_build(overlay)))
    res = run(tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, str(rendered))
    assert res.returncode == 0, res.stdout + res.stderr


def test_plain_manifests_validate() -> None:
    files = [KUBE / "base" / f for f in ("deployment.yaml", "service.yaml", "hpa.yaml")]
    files += [KUBE / "secret.example.yaml", KUBE / "overlays" / "gpu" / "cache-pvc.yaml"]
    res = run(tool("kubernetes-validate"), "--strict", "--quiet", *map(str, files))
    assert res.returncode == 0, res.stdout + res.stderr


def _by_kind(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_agrees_with_the_server(overlay: str) -> None:
    docs = kustomize_build(overlay)
    deployment = _by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    (pull,) = pod["initContainers"]
    assert pull["command"][:2] == ["ferrum", "pull"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["startupProbe"]["httpGet"]["path"] == "/ready"
    assert server["ports"][0]["containerPort"] == 8000
    # security: non-root, read-only root file system, nothing to escalate
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    for c in (server, pull):
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/var/cache/ferrum", "/tmp", "/etc/ferrum"} <= mounts
        assert {"configMapRef": {"name": _by_kind_named(docs, "ferrum-settings")}} in c["envFrom"]
        assert {"secretRef": {"name": "ferrum-credentials", "optional": True}} in c["envFrom"]
    # the grace period outlasts the preStop pause plus the server's drain
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}))
    drain = yaml.safe_load(config_map["data"]["config.yaml"])["shutdown_timeout_s"]
    pause = int(server["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pause + drain
    settings = next(d for d in docs if d["kind"] == "ConfigMap" and "FERRUM_MODEL" in d.get("data", {}))["data"]
    load_config(None, {}, environ=settings)  # every FERRUM_* key there names a setting
    assert settings["FERRUM_BACKEND"] == overlay.replace("gpu", "cuda")
    if overlay == "gpu":
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "/dev/shm" in {m["mountPath"] for m in server["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
        claim = volumes["cache"]["persistentVolumeClaim"]["claimName"]
        assert _by_kind(docs, "PersistentVolumeClaim")["metadata"]["name"] == claim
        assert server["image"].endswith(":cuda")
    else:
        assert server["image"].endswith(":cpu") and deployment["spec"]["replicas"] == 2


def _by_kind_named(docs: list[dict], prefix: str) -> str:
    """The generated (hash-suffixed) name of the ConfigMap `prefix`."""
    (name,) = [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"
               and d["metadata"]["name"].startswith(prefix + "-")]
    return name


def test_autoscaler_reads_a_metric_the_server_exports() -> None:
    hpa = _by_kind(kustomize_build("cpu"), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "ferrum_num_requests_waiting" and name in METRIC_NAMES
    rules = yaml.safe_load((KUBE / "prometheus-adapter" / "rules.yaml").read_text())["rules"]["custom"]
    assert any(name in r["seriesQuery"] and r["name"]["as"] == name for r in rules)
