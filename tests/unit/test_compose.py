"""docker-compose.yml parses, and every command it runs exists in the project."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import typer.main
import yaml

from tierq.cli.main import app
from tierq.workers.celery_flags import QUIET_WORKER_FLAGS

ROOT = Path(__file__).resolve().parents[2]


def _services() -> dict[str, dict[str, object]]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services: dict[str, dict[str, object]] = doc["services"]
    return services


def test_the_deployment_has_every_component() -> None:
    services = _services()
    assert {
        "postgres",
        "redis",
        "migrate",
        "api",
        "dispatcher",
        "worker",
        "celery-worker",
        "celery-beat",
    } <= set(services)
    assert "--appendonly" in services["redis"]["command"]  # type: ignore[operator]
    assert services["dispatcher"]["deploy"]["replicas"] == 2  # type: ignore[index]  # a standby
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]  # type: ignore[index]
    assert devices[0]["driver"] == "nvidia"
    assert (ROOT / "Dockerfile").is_file()


def test_the_services_share_no_disk() -> None:
    """Files go through the object store (FILES_URL, a service of its own): no tierq
    service mounts a volume another one writes, so each may run on its own host."""
    services = _services()
    assert "s3" in services
    for name in ("api", "worker", "worker-gpus", "celery-worker", "celery-beat", "migrate"):
        env = services[name]["environment"]
        assert str(env["FILES_URL"]).startswith("s3://") and "FILES_DIR" not in env, name  # type: ignore[index,operator]
        mounts = [str(v) for v in services[name].get("volumes", [])]  # type: ignore[attr-defined]
        assert all(m.endswith(":ro") for m in mounts), (name, mounts)  # read-only: the model


def test_every_command_exists() -> None:
    cli = typer.main.get_command(app)
    checked = 0
    for name, service in _services().items():
        command = service.get("command")
        if not isinstance(command, list) or command[0] not in ("tierq", "celery"):
            continue
        if command[0] == "tierq":
            sub = cli.commands.get(command[1])  # type: ignore[attr-defined]
            assert sub is not None, f"{name}: 'tierq {command[1]}' is not a command"
            options = {opt for p in sub.params for opt in getattr(p, "opts", [])}
            for arg in command[2:]:
                if arg.startswith("--"):
                    assert arg in options, f"{name}: 'tierq {command[1]}' has no {arg}"
        else:
            module = command[command.index("-A") + 1]
            if command[command.index("-A") + 2] == "worker":  # no pub/sub steps
                assert set(QUIET_WORKER_FLAGS) <= set(command), (name, command)
            celery_app = importlib.import_module(module).app
            assert command[command.index("-A") + 2] in ("worker", "beat")
            assert "tierq.reconcile" in celery_app.conf.beat_schedule["reconcile"]["task"]
            importlib.import_module("tierq.workers.tasks")
            assert "tierq.reconcile" in celery_app.tasks
            if "-Q" in command:  # a queue that this deployment's tasks are routed to
                queue = command[command.index("-Q") + 1]
                assert queue in {q.name for q in celery_app.conf.task_queues}, (name, queue)
        checked += 1
    # migrate, api, dispatcher, worker, the multi-GPU worker, celery worker, the reconciler's
    # celery worker, beat
    assert checked == 8


def test_the_reconciler_has_a_celery_worker_of_its_own() -> None:
    """Batch validation on the default queue can never delay the reconciler."""
    from tierq.workers.celery_app import app as celery_app

    queues = {
        name: s["command"] for name, s in _services().items() if "-Q" in str(s.get("command"))
    }
    route = celery_app.conf.task_routes["tierq.reconcile"]["queue"]
    consumers = [n for n, cmd in queues.items() if route in cmd]  # type: ignore[operator]
    assert consumers == ["celery-reconciler"]
    assert route not in queues["celery-worker"]  # type: ignore[operator]


def test_the_image_copies_every_package_the_project_installs() -> None:
    """A layer added to pyproject.toml's packages must reach the image too."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and len(line.split()) == 3
    }
    assert packages <= copied, packages - copied


def test_the_keda_example_scales_workers_on_the_signal_the_dispatcher_exports() -> None:
    from tierq.core import metrics

    scaled = yaml.safe_load((ROOT / "deploy" / "keda-scaledobject.yaml").read_text())
    assert scaled["kind"] == "ScaledObject"
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    assert metrics.DESIRED_WORKERS._name in trigger["metadata"]["query"]  # type: ignore[attr-defined]
    # ...for the model the compose file's workers serve (SERVED_MODEL_NAME's default there).
    served = str(_services()["worker"]["environment"]["SERVED_MODEL_NAME"])  # type: ignore[index]
    default = served.removeprefix("${SERVED_MODEL_NAME:-").removesuffix("}")
    assert f'model="{default}"' in trigger["metadata"]["query"], (served, trigger)


def test_gpu_workers_share_memory_and_a_multi_gpu_host_runs_one_engine_per_group() -> None:
    """vLLM's processes share tensors through /dev/shm (64 MB in a container by default);
    the multi-gpu profile takes every GPU of its host and runs `tierq worker --gpus all`,
    whose engines' metrics ports (9102 + i, 9202 + i) never meet for up to eight GPUs and
    are the ones Prometheus scrapes."""
    services = _services()
    for name in ("worker", "worker-gpus"):
        assert services[name].get("ipc") == "host" or services[name].get("shm_size"), name
    gpus = services["worker-gpus"]
    assert gpus["profiles"] == ["multi-gpu"] and gpus["init"] is True
    command = [str(a) for a in gpus["command"]]  # type: ignore[attr-defined]
    assert command[command.index("--gpus") + 1] == "all"
    metrics = int(command[command.index("--metrics-port") + 1])
    tenants = int(command[command.index("--tenant-metrics-port") + 1])
    assert not set(range(metrics, metrics + 8)) & set(range(tenants, tenants + 8))
    devices = gpus["deploy"]["resources"]["reservations"]["devices"]  # type: ignore[index]
    assert devices[0]["count"] == "all"
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    for job, first in (("worker", metrics), ("worker-tenants", tenants)):
        ports = {c["port"] for c in jobs[job]["dns_sd_configs"] if c["names"] == ["worker-gpus"]}
        assert ports == set(range(first, first + 8)), job


def test_the_kubernetes_multi_gpu_worker_splits_its_gpus_into_engines() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "k8s" / "worker-multi-gpu.yaml").read_text())
    pod = doc["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:4] == ["tierq", "worker", "--gpus", "all"]
    env = {e["name"]: e for e in container["env"]}
    assert env["WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    engines = gpus // int(env["TENSOR_PARALLEL_SIZE"]["value"])
    assert gpus % int(env["TENSOR_PARALLEL_SIZE"]["value"]) == 0
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports == {9102 + i for i in range(engines)} | {9202 + i for i in range(engines)}
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # The pause process reaps what a dead engine leaves; the KEDA example's threshold, for
    # pods of several engines, is said beside it (the signal counts engines).
    assert pod["shareProcessNamespace"] is True
    keda = yaml.safe_load((ROOT / "deploy" / "keda-scaledobject.yaml").read_text())
    assert keda["spec"]["scaleTargetRef"]["name"] == doc["metadata"]["name"]
    text = (ROOT / "deploy" / "k8s" / "worker-multi-gpu.yaml").read_text()
    assert f'set its threshold to the engines a pod runs ("{engines}"' in text


def test_the_gpu_image_is_built_on_cuda_with_a_compiler_and_the_tested_pins() -> None:
    """Triton and FlashInfer compile launchers with a C compiler at run time; the CUDA build
    installs with the constraints the tests ran against (vLLM's pin among them)."""
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG CUDA_BASE=nvidia/cuda:" in text and "FROM ${CUDA_BASE} AS base-gpu" in text
    gpu_stage = text[text.index("AS base-gpu") : text.index("AS base-cpu")]
    assert "gcc" in gpu_stage and "--python 3.11" in gpu_stage
    assert '-c deploy/gpu/constraints.txt ".[gpu,otel]"' in text
    pins = (ROOT / "deploy" / "gpu" / "constraints.txt").read_text().splitlines()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras["optional-dependencies"]["gpu"][0] in pins  # vllm==<the extra's pin>
    assert any(p.startswith("torch==") and "+" not in p for p in pins)  # PyPI's CUDA build
