"""Build Ferrum's CPU image from the real `Dockerfile` with podman and run it the way a container engine would.

No Docker engine and no registry are reachable here, so:
1. the base image is a Debian bookworm made with debootstrap (python3, python3-venv), imported into podman
   and cached outside the clone (a tar file keyed by the hash of the recipe that builds it);
2. the image is built with `podman build --format docker` (the OCI format drops HEALTHCHECK), PyTorch's CPU
   wheel coming from this machine's pip (mounted into the build, passed as TORCH_FIND_LINKS);
3. `podman inspect` must show the health check, the non-root user, the entrypoint, the stop signal and port;
4. `podman run` cannot start containers on these machines (setrlimit is refused), so the image's own
   entrypoint + command run with `buildah run` as the image's user, on the host network:
   - the demo model mounted read-only: wait for /ready, run the image's HEALTHCHECK command inside it, a chat
     request through the official `openai` client must answer "Paris", SIGTERM must exit 0;
   - the same model served from a moto S3 endpoint (`s3://` + AWS_* variables), the cache in a volume;
   - docker/Dockerfile.cuda built on the same Debian base with the CPU torch (its NVIDIA base and CUDA torch
     cannot be had here), inspected the same way, serving the demo model;
   - `--read-only` cannot be run either: instead the container's root filesystem is listed before and after
     each run, and any file the server created or changed outside the volume and the tmpfs fails the check.

Prints what it measured (image size, build and start times) and exits non-zero on the first failure.

    python scripts/check_container_image.py [--model models/SmolLM2-135M-Instruct] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "localhost/ferrum:check"
CUDA_STRUCTURE_IMAGE = "localhost/ferrum:check-cuda-dockerfile"
MAX_IMAGE_BYTES = 1_500_000_000
USER = "10001:10001"


class BaseRecipe(TypedDict):
    suite: str
    variant: str
    include: list[str]
    mirror: str
    cleanup: list[str]
    recipe_version: int


# Everything that decides what the base image holds; its hash names the cached file.
BASE_RECIPE: BaseRecipe = {
    "suite": "bookworm",
    "variant": "minbase",
    "include": ["python3", "python3-venv", "ca-certificates", "g++"],
    "mirror": "http://deb.debian.org/debian",
    "cleanup": ["var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "usr/share/doc/*", "usr/share/man/*"],
    "recipe_version": 2,
}


class CheckFailed(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[container-check] {msg}", flush=True)


def sh(*cmd: str, capture: bool = False, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), text=True, capture_output=capture, **kw)
    if check and res.returncode != 0:
        out = (res.stderr or res.stdout or "")[-3000:] if capture else ""
        raise CheckFailed(f"command failed ({res.returncode}): {' '.join(cmd)}\n{out}")
    return res


def podman(*args: str, **kw) -> subprocess.CompletedProcess:
    return sh("podman", "--runtime", "runc", *args, **kw)


def cache_root() -> Path:
    root = Path(os.environ.get("FERRUM_CI_CACHE") or Path.home() / ".cache" / "ferrum-ci")
    root.mkdir(parents=True, exist_ok=True)
    return root


# -- 1. the base image --------------------------------------------------------------------------------------


def base_image() -> str:
    key = hashlib.sha256(json.dumps(BASE_RECIPE, sort_keys=True).encode()).hexdigest()[:16]
    tag = f"localhost/ferrum-base:{key}"
    if podman("image", "exists", tag, check=False).returncode == 0:
        log(f"base image {tag}: already in podman's storage")
        return tag
    tarball = cache_root() / f"base-{key}.tar"
    if not tarball.exists():
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="ferrum-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            sh("debootstrap", f"--variant={BASE_RECIPE['variant']}", f"--include={','.join(BASE_RECIPE['include'])}",
               BASE_RECIPE["suite"], str(rootfs), BASE_RECIPE["mirror"], capture=True)
            for pattern in BASE_RECIPE["cleanup"]:
                for p in rootfs.glob(pattern):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            partial = tarball.with_suffix(".partial")
            sh("tar", "-C", str(rootfs), "-cf", str(partial), ".")
            partial.rename(tarball)
        log(f"base image: debootstrap {BASE_RECIPE['suite']} in {time.perf_counter() - t0:.0f} s -> {tarball}")
    with tarball.open("rb") as f:
        podman("import", "-", tag, stdin=f, capture=True)
    log(f"base image {tag}: imported from {tarball}")
    return tag


def torch_wheel_dir() -> Path:
    """This machine's CPU build of torch, as pip resolves the Makefile's pin, in a folder to mount."""
    pin = "torch==" + _makefile_torch_pin()
    dest = cache_root() / "wheels"
    sh(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(dest), pin, capture=True)
    wheels = sorted(dest.glob(f"torch-{pin.split('==')[1]}*.whl"))
    if not wheels:
        raise CheckFailed(f"pip download {pin} left no wheel in {dest}")
    log(f"torch wheel: {wheels[-1].name}")
    return dest


def _makefile_torch_pin() -> str:
    for line in (ROOT / "Makefile").read_text().splitlines():
        if "pip install" in line and "torch==" in line:
            return line.split("torch==")[1].split()[0]
    raise CheckFailed("Makefile: no `pip install ... torch==X` line")


# -- 2. build and 3. inspect --------------------------------------------------------------------------------


def pip_cert() -> Path | None:
    """The CA bundle this machine's pip trusts (PIP_CERT or pip's config), if it names one: a TLS-inspecting
    proxy's certificate is in it and not in the base image."""
    named = os.environ.get("PIP_CERT") or sh(
        sys.executable, "-m", "pip", "config", "get", "global.cert", capture=True, check=False).stdout.strip()
    return Path(named).resolve() if named and Path(named).is_file() else None


def build(base: str, wheels: Path, dockerfile: str = "Dockerfile", tag: str = IMAGE) -> float:
    t0 = time.perf_counter()
    cert_args: list[str] = []
    if (cert := pip_cert()) is not None:
        cert_args = ["-v", f"{cert}:/build-ca.crt:ro", "--build-arg", "PIP_CERT=/build-ca.crt"]
    podman("build", "--format", "docker", "--network", "host", "-v", f"{wheels}:/wheels:ro", *cert_args,
           "--build-arg", f"BASE_IMAGE={base}",
           "--build-arg", f"TORCH_SPEC=torch=={_makefile_torch_pin()}",
           "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple",
           "--build-arg", "TORCH_FIND_LINKS=/wheels",
           "-t", tag, "-f", str(ROOT / dockerfile), str(ROOT))
    return time.perf_counter() - t0


def healthcheck(info: dict) -> dict:
    """podman keeps a docker-format image's HEALTHCHECK beside Config, docker inside it."""
    return info.get("Healthcheck") or info["Config"].get("Healthcheck") or {}


def inspect(tag: str = IMAGE) -> dict:
    info = json.loads(podman("image", "inspect", tag, capture=True).stdout)[0]
    cfg = info["Config"]
    problems = []
    health = healthcheck(info)
    if not health.get("Test") or "/ready" not in " ".join(health["Test"]):
        problems.append(f"no HEALTHCHECK on /ready: {health}")
    if cfg.get("User") != USER:
        problems.append(f"user {cfg.get('User')!r}, expected {USER}")
    entry = cfg.get("Entrypoint") or []
    if entry[:1] != ["dumb-init"] or "ferrum" not in entry or "serve" not in entry:
        problems.append(f"entrypoint {entry}: expected dumb-init ... ferrum serve")
    if cfg.get("StopSignal") != "SIGTERM":
        problems.append(f"stop signal {cfg.get('StopSignal')!r}, expected SIGTERM")
    if "8000/tcp" not in (cfg.get("ExposedPorts") or {}):
        problems.append(f"exposed ports {cfg.get('ExposedPorts')}, expected 8000/tcp")
    if "/var/cache/ferrum" not in (cfg.get("Volumes") or {}):
        problems.append(f"volumes {cfg.get('Volumes')}, expected /var/cache/ferrum")
    if problems:
        raise CheckFailed("image configuration: " + "; ".join(problems))
    return info


# -- 4. run it ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# files buildah itself writes into a working container for each `buildah run`
BUILDAH_WRITES = {"/etc/hosts", "/etc/resolv.conf", "/etc/hostname", "/run/.containerenv", "/run", "/etc"}


def rootfs_listing(container: str) -> dict[str, tuple[int, int]]:
    """(mtime, size) of every path on the container's root filesystem, mounts excluded (the volume and the
    tmpfs are mounted only while a command runs)."""
    root = Path(sh("buildah", "mount", container, capture=True).stdout.strip())
    listing: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            with contextlib.suppress(FileNotFoundError):
                st = full.lstat()
                listing["/" + str(full.relative_to(root))] = (st.st_mtime_ns, st.st_size)
    return listing


def rootfs_writes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
                  mounts: list[str]) -> list[str]:
    """Paths created, changed or removed on the root filesystem: what `--read-only` would have refused.
    The mount points buildah creates (and their parents) are not the server's writes."""
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    mount_points = {str(Path(m).joinpath(*[".."] * i).resolve()) for m in mounts for i in range(len(Path(m).parts))}
    return sorted(p for p in changed - BUILDAH_WRITES - mount_points
                  if not any(p.startswith(m.rstrip("/") + "/") for m in mounts))


@contextlib.contextmanager
def working_container(tag: str) -> Iterator[str]:
    name = sh("buildah", "from", tag, capture=True).stdout.strip().splitlines()[-1]
    try:
        yield name
    finally:
        sh("buildah", "rm", name, capture=True, check=False)


def _run_args(container: str, env: dict[str, str], volumes: list[str]) -> list[str]:
    # no `--mount type=tmpfs,destination=/tmp`: with any --mount, buildah 1.28 drops the -v bind mounts (the
    # image's VOLUME gets an anonymous volume instead); /tmp stays on the container's file system and counts as
    # the tmpfs in rootfs_writes
    args = ["buildah", "run", "--runtime", "runc", "--network", "host", "--user", USER]
    for k, v in env.items():
        args += ["-e", f"{k}={v}"]
    for v in volumes:
        args += ["-v", v]
    return args + [container, "--"]


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise CheckFailed(f"the container exited with status {proc.returncode} before /ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise CheckFailed(f"/ready not 200 within {timeout_s:.0f} s")


def _server_pid(port: int) -> int | None:
    """The container's PID 1 (dumb-init) as the host sees it: found by the port in its environment."""
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            cmdline = (proc_dir / "cmdline").read_bytes().split(b"\0")
            environ = (proc_dir / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if os.path.basename(cmdline[0]) == b"dumb-init" and f"FERRUM_PORT={port}".encode() in environ:
            return int(proc_dir.name)
    return None


def serve_and_check(info: dict, label: str, env: dict[str, str], volumes: list[str], report: dict,
                    tag: str = IMAGE) -> None:
    from openai import OpenAI

    cfg = info["Config"]
    port = free_port()
    env = {**env, "FERRUM_HOST": "127.0.0.1", "FERRUM_PORT": str(port), "FERRUM_LOGGING__FORMAT": "text"}
    command = list(cfg["Entrypoint"]) + list(cfg.get("Cmd") or [])
    with working_container(tag) as container:
        log(f"{label}: buildah run --user {USER} {' '.join(command)}")
        before = rootfs_listing(container)
        t0 = time.perf_counter()
        proc = subprocess.Popen(_run_args(container, env, volumes) + command)
        try:
            ready_s = wait_ready(port, proc, timeout_s=600)
            health = sh(*_run_args(container, {"FERRUM_PORT": str(port)}, []), *healthcheck(info)["Test"][1:],
                        check=False, capture=True)
            if health.returncode != 0:
                raise CheckFailed(f"{label}: the image's HEALTHCHECK failed on a ready server: {health.stderr[-500:]}")
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0, max_tokens=24,
            )
            answer = reply.choices[0].message.content or ""
            if "Paris" not in answer:
                raise CheckFailed(f"{label}: expected 'Paris' in the answer, got {answer!r}")
            if (pid := _server_pid(port)) is None:
                raise CheckFailed(f"{label}: no dumb-init process with FERRUM_PORT={port} on this host")
            os.kill(pid, signal.SIGTERM)
            status = proc.wait(timeout=120)
            if status != 0:
                raise CheckFailed(f"{label}: exit status {status} after SIGTERM, expected 0")
            mounts = ["/tmp", *(v.split(":")[1] for v in volumes)]
            if writes := rootfs_writes(before, rootfs_listing(container), mounts):
                raise CheckFailed(f"{label}: the server wrote outside its volume and /tmp (a read-only root "
                                  f"filesystem would refuse): {writes[:20]}")
        finally:
            if proc.poll() is None:  # killing `buildah run` leaves the container's processes running
                if (pid := _server_pid(port)) is not None:
                    os.kill(pid, signal.SIGKILL)
                proc.kill()
                proc.wait()
    report[label] = {"ready_s": round(ready_s, 1), "answer": answer, "exit_after_sigterm": status,
                     "wall_s": round(time.perf_counter() - t0, 1)}
    log(f"{label}: ready in {ready_s:.1f} s, answered {answer!r}, SIGTERM -> exit {status}")


def _cache_volume(tmp: Path, name: str) -> str:
    d = tmp / name
    d.mkdir()
    os.chown(d, 10001, 10001)
    return str(d)


def check_runs(info: dict, model: Path, report: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="ferrum-container-") as tmp_name:
        tmp = Path(tmp_name)
        serve_and_check(info, "local-model", {"FERRUM_MODEL": "/models/demo"},
                        [f"{model}:/models/demo:ro", f"{_cache_volume(tmp, 'cache1')}:/var/cache/ferrum"], report)
        with moto_bucket(model) as (endpoint, uri):
            env = {"FERRUM_MODEL": uri, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "check",
                   "AWS_SECRET_ACCESS_KEY": "check", "AWS_REGION": "us-east-1"}
            serve_and_check(info, "s3-model", env, [f"{_cache_volume(tmp, 'cache2')}:/var/cache/ferrum"], report)
            inodes = {(st.st_ino, st.st_size) for p in (tmp / "cache2").rglob("*") if p.is_file() and (st := p.stat())}
            cached = sum(size for _, size in inodes)  # hard links (blob and model folder) once
            if cached < sum(p.stat().st_size for p in model.glob("*.safetensors")):
                raise CheckFailed(f"s3-model: the cache volume holds {cached} bytes, less than the weights")
            report["s3-model"]["cache_volume_bytes"] = cached


def check_cuda_dockerfile(base: str, model: Path, report: dict) -> None:
    """docker/Dockerfile.cuda cannot be built as intended here (no NVIDIA base image, no CUDA torch, no GPU):
    every instruction of it is exercised on the Debian base with the CPU torch instead, and the result must
    pass the same inspection and serve the demo model."""
    seconds = build(base, torch_wheel_dir(), dockerfile="docker/Dockerfile.cuda", tag=CUDA_STRUCTURE_IMAGE)
    info = inspect(CUDA_STRUCTURE_IMAGE)
    log(f"docker/Dockerfile.cuda on the Debian base: built in {seconds:.0f} s, {info['Size'] / 1e9:.2f} GB")
    report["cuda_dockerfile_on_cpu_base"] = {"build_s": round(seconds, 1), "image_bytes": int(info["Size"])}
    with tempfile.TemporaryDirectory(prefix="ferrum-container-") as tmp_name:
        serve_and_check(info, "cuda-dockerfile-on-cpu-base", {"FERRUM_MODEL": "/models/demo"},
                        [f"{model}:/models/demo:ro", f"{_cache_volume(Path(tmp_name), 'cache')}:/var/cache/ferrum"],
                        report, tag=CUDA_STRUCTURE_IMAGE)


@contextlib.contextmanager
def moto_bucket(model: Path) -> Iterator[tuple[str, str]]:
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="check", aws_secret_access_key="check")
        s3.create_bucket(Bucket="models")
        for f in sorted(model.iterdir()):
            if f.is_file():
                s3.upload_file(str(f), "models", f"smollm2/{f.name}")
        yield endpoint, "s3://models/smollm2"
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--keep", action="store_true", help="keep the built image (default: removed at the end)")
    p.add_argument("--report", type=Path, help="write what was measured as JSON here")
    p.add_argument("--skip-cuda-dockerfile", action="store_true",
                   help="do not build docker/Dockerfile.cuda on the Debian base with the CPU torch")
    args = p.parse_args()
    for tool in ("podman", "buildah", "debootstrap"):
        if shutil.which(tool) is None:
            print(f"check_container_image: {tool} is not installed (apt-get install podman buildah runc debootstrap)",
                  file=sys.stderr)
            return 2
    model = args.model.resolve()
    if not (model / "config.json").exists():
        print(f"check_container_image: no model at {model} (run `make model`)", file=sys.stderr)
        return 2
    report: dict = {}
    try:
        t0 = time.perf_counter()
        base = base_image()
        report["base_s"] = round(time.perf_counter() - t0, 1)
        report["build_s"] = round(build(base, torch_wheel_dir()), 1)
        info = inspect()
        report["image_bytes"] = int(info["Size"])
        log(f"image {IMAGE}: {info['Size'] / 1e9:.2f} GB, built in {report['build_s']:.0f} s")
        if info["Size"] > MAX_IMAGE_BYTES:
            raise CheckFailed(f"image is {info['Size'] / 1e9:.2f} GB, over the {MAX_IMAGE_BYTES / 1e9:.1f} GB target")
        check_runs(info, model, report)
        if not args.skip_cuda_dockerfile:
            check_cuda_dockerfile(base, model, report)
    except CheckFailed as exc:
        print(f"check_container_image: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.report:
            args.report.write_text(json.dumps(report, indent=2) + "\n")
        if not args.keep:
            podman("rmi", "-f", IMAGE, CUDA_STRUCTURE_IMAGE, check=False, capture=True)
    log("all checks passed: " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
