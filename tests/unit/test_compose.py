"""docker-compose.yml parses, and every command it runs exists in the project."""

from __future__ import annotations

import importlib
from pathlib import Path

import typer.main
import yaml

from cli.main import app

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
    for name in ("api", "worker", "celery-worker", "celery-beat", "migrate"):
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
            celery_app = importlib.import_module(module).app
            assert command[command.index("-A") + 2] in ("worker", "beat")
            assert "tierq.reconcile" in celery_app.conf.beat_schedule["reconcile"]["task"]
            importlib.import_module("workers.tasks")
            assert "tierq.reconcile" in celery_app.tasks
            if "-Q" in command:  # a queue that this deployment's tasks are routed to
                queue = command[command.index("-Q") + 1]
                assert queue in {q.name for q in celery_app.conf.task_queues}, (name, queue)
        checked += 1
    # migrate, api, dispatcher, worker, celery worker, the reconciler's celery worker, beat
    assert checked == 7


def test_the_reconciler_has_a_celery_worker_of_its_own() -> None:
    """Batch validation on the default queue can never delay the reconciler."""
    from workers.celery_app import app as celery_app

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
    from tierq import metrics

    scaled = yaml.safe_load((ROOT / "deploy" / "keda-scaledobject.yaml").read_text())
    assert scaled["kind"] == "ScaledObject"
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "1"
    assert metrics.DESIRED_WORKERS._name in trigger["metadata"]["query"]  # type: ignore[attr-defined]
    # ...for the model the compose file's workers serve (SERVED_MODEL_NAME's default there).
    served = str(_services()["worker"]["environment"]["SERVED_MODEL_NAME"])  # type: ignore[index]
    default = served.removeprefix("${SERVED_MODEL_NAME:-").removesuffix("}")
    assert f'model="{default}"' in trigger["metadata"]["query"], (served, trigger)
