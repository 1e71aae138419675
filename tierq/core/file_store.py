"""Where the bytes of uploaded and generated files live: a folder on this host (the embedded
default, FILES_DIR) or an S3-compatible object store that every host shares
(FILES_URL=s3://bucket/prefix; endpoint and credentials from the standard AWS variables:
AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION).

One contract for both, blocking (callers run it in a thread, as they would plain file I/O):
- a write is invisible until it is committed and then appears whole under its name: a local
  `.part` file renamed into place, or an S3 multipart upload completed (a file of less than
  one part is one PUT at commit). An aborted write leaves nothing; a write that a crash left
  behind is removed by `remove_incomplete` once untouched for the sweep's age.
- a read streams from a byte offset (S3: a ranged GET), never holding the file in memory.

Names are file ids (`file_...`); on S3 they are keys under the prefix.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

READ_BUFFER = 1024 * 1024  # bytes a reader asks for at a time
# S3 multipart parts: at least 5 MiB but the last (the S3 contract); what a writer holds.
PART_BYTES = 8 * 1024 * 1024
DELETE_PAGE = 1000  # keys one S3 DeleteObjects may name


class StoreUnavailable(Exception):
    """The object store could not be reached or refused a request (not a missing file).
    `failed`: the files of a delete it refused one by one (the others are gone)."""

    def __init__(self, message: str, failed: list[str] | None = None) -> None:
        super().__init__(message)
        self.failed = failed or []


class Writer(ABC):
    """One file being written. `commit` or `abort` ends it; either is final."""

    size: int = 0

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    def touch(self) -> None:
        """A sign of life: a write touched recently is never swept as a crash's leftover."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file appear, whole, under its name."""

    @abstractmethod
    def abort(self) -> None:
        """Leave nothing of it (idempotent; also after a failed commit)."""


class FileStore(ABC):
    @abstractmethod
    def prepare(self) -> str:
        """Make the store ready to take files (the folder; the bucket, if it is missing and
        the credentials may create it): `tierq migrate` does it once per deployment. What
        it did, in words."""

    @abstractmethod
    def create(self, name: str) -> Writer: ...

    @abstractmethod
    def open(self, name: str, offset: int = 0) -> BinaryIO:
        """A buffered reader from byte `offset` (iterate it for lines); FileNotFoundError
        if there is no such file. Close it (a `with` block)."""

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Remove these files; a name that is not there is fine."""

    @abstractmethod
    def committed_before(self, cutoff: float) -> list[str]:
        """The files (`file_*`) last written at or before `cutoff` (epoch seconds)."""

    @abstractmethod
    def remove_incomplete(self, cutoff: float) -> list[str]:
        """Remove the writes neither committed nor aborted and untouched since `cutoff`
        (left by a crash); their names."""

    def chunks(self, name: str, offset: int = 0) -> Iterator[bytes]:
        """The file's bytes from `offset`, READ_BUFFER at a time (FileNotFoundError first)."""
        reader = self.open(name, offset)
        with reader:
            while chunk := reader.read(READ_BUFFER):
                yield chunk


# --- a folder --------------------------------------------------------------------------


class _LocalWriter(Writer):
    def __init__(self, target: Path) -> None:
        self.target = target
        self.part = target.with_name(target.name + ".part")
        self.size = 0
        self._out: BinaryIO | None = self.part.open("wb")

    def write(self, data: bytes) -> None:
        assert self._out is not None, "written after its end"
        self._out.write(data)
        self.size += len(data)

    def touch(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.part)

    def commit(self) -> None:
        assert self._out is not None, "committed after its end"
        out, self._out = self._out, None
        out.close()
        self.part.rename(self.target)
        os.utime(self.target)  # the orphan sweep counts a file's age from here

    def abort(self) -> None:
        out, self._out = self._out, None
        if out is not None:
            out.close()
        self.part.unlink(missing_ok=True)


class LocalStore(FileStore):
    """Files in one folder: `<id>` once committed, `<id>.part` while written."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def prepare(self) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        return f"files in {self.folder}"

    def create(self, name: str) -> Writer:
        self.folder.mkdir(parents=True, exist_ok=True)
        return _LocalWriter(self.folder / name)

    def open(self, name: str, offset: int = 0) -> BinaryIO:
        f = (self.folder / name).open("rb", buffering=READ_BUFFER)
        f.seek(offset)
        return f

    def exists(self, name: str) -> bool:
        return (self.folder / name).is_file()

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            (self.folder / name).unlink(missing_ok=True)

    def committed_before(self, cutoff: float) -> list[str]:
        if not self.folder.is_dir():
            return []
        names: list[str] = []
        for path in self.folder.glob("file_*"):
            if path.suffix == ".part":
                continue
            with contextlib.suppress(FileNotFoundError):
                if path.is_file() and path.stat().st_mtime <= cutoff:
                    names.append(path.name)
        return names

    def remove_incomplete(self, cutoff: float) -> list[str]:
        if not self.folder.is_dir():
            return []
        removed: list[str] = []
        for path in self.folder.glob("*.part"):
            try:
                if path.is_file() and path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed.append(path.name.removesuffix(".part"))
            except FileNotFoundError:  # committed or removed meanwhile
                continue
        return removed


# --- an S3-compatible object store -----------------------------------------------------


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """`s3://bucket` or `s3://bucket/some/prefix`; ValueError for anything else."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"FILES_URL must look like s3://bucket/prefix, not {url!r}")
        prefix = parts.path.strip("/")
        return cls(parts.netloc, prefix + "/" if prefix else "")


def _unavailable(exc: Exception) -> StoreUnavailable:
    return StoreUnavailable(f"the object store failed: {exc}")


def _code(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _not_found(exc: Any) -> bool:
    return _code(exc) in ("NoSuchKey", "404", "NotFound", "NoSuchUpload")


class _S3Body(io.RawIOBase):
    """An S3 GetObject body as a raw stream, so that io.BufferedReader can split its lines."""

    def __init__(self, body: Any) -> None:
        self.body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.body.close()
        super().close()


class _S3Writer(Writer):
    """Held in memory up to one part; a multipart upload once a part is full."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.store, self.key = store, key
        self.size = 0
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._ended = False

    def write(self, data: bytes) -> None:
        assert not self._ended, "written after its end"
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= PART_BYTES:
            self._upload_part(bytes(self._buffer[:PART_BYTES]))
            del self._buffer[:PART_BYTES]

    def touch(self) -> None:
        """Nothing to do: an open upload's sign of life is its last part's time (a write
        that has not filled a part yet has nothing stored to sweep)."""

    def commit(self) -> None:
        assert not self._ended, "committed after its end"
        client, bucket = self.store.client(), self.store.location.bucket
        try:
            if self._upload_id is None:
                client.put_object(Bucket=bucket, Key=self.key, Body=bytes(self._buffer))
            else:
                if self._buffer or not self._parts:
                    self._upload_part(bytes(self._buffer))
                client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=self.key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
        except self.store.errors as exc:
            raise _unavailable(exc) from exc
        self._ended, self._upload_id = True, None
        self._buffer.clear()

    def abort(self) -> None:
        self._ended = True
        self._buffer.clear()
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            try:
                self.store.client().abort_multipart_upload(
                    Bucket=self.store.location.bucket, Key=self.key, UploadId=upload_id
                )
            except self.store.errors as exc:
                if not _not_found(exc):  # else the sweep aborts it later
                    raise _unavailable(exc) from exc

    def _upload_part(self, data: bytes) -> None:
        client, bucket = self.store.client(), self.store.location.bucket
        try:
            if self._upload_id is None:
                made = client.create_multipart_upload(Bucket=bucket, Key=self.key)
                self._upload_id = str(made["UploadId"])
            number = len(self._parts) + 1
            got = client.upload_part(
                Bucket=bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=data
            )
        except self.store.errors as exc:
            raise _unavailable(exc) from exc
        self._parts.append({"PartNumber": number, "ETag": got["ETag"]})


class S3Store(FileStore):
    """Objects `<prefix><id>` in one bucket. The bucket must exist (the operator's, with
    the credentials' rights to read, write, list and delete in it and to run multipart
    uploads)."""

    def __init__(self, location: S3Location) -> None:
        import botocore.exceptions

        self.location = location
        self.errors: tuple[type[Exception], ...] = (
            botocore.exceptions.BotoCoreError,
            botocore.exceptions.ClientError,
        )
        self._client: Any = None
        self._lock = threading.Lock()
        self._pid = 0

    def client(self) -> Any:
        """One client per process (thread-safe once made; a forked child makes its own)."""
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                import boto3
                from botocore.config import Config

                config = Config(
                    retries={"mode": "standard", "max_attempts": 4},
                    connect_timeout=5,
                    read_timeout=60,
                    # Checksums only where S3 requires them: several S3-compatible stores
                    # refuse the CRC32 headers newer botocore sends on every request.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                self._client = boto3.session.Session().client("s3", config=config)
                self._pid = os.getpid()
            return self._client

    def _key(self, name: str) -> str:
        return self.location.prefix + name

    def prepare(self) -> str:
        client, bucket = self.client(), self.location.bucket
        try:
            client.head_bucket(Bucket=bucket)
            return f"files in s3://{bucket}/{self.location.prefix}"
        except self.errors as exc:
            if not _not_found(exc) and "NoSuchBucket" not in str(exc):
                raise _unavailable(exc) from exc
        region = client.meta.region_name
        where = {}
        if region and region != "us-east-1":  # S3's own rule: elsewhere, it is named
            where = {"CreateBucketConfiguration": {"LocationConstraint": region}}
        try:
            client.create_bucket(Bucket=bucket, **where)
        except self.errors as exc:
            if "BucketAlreadyOwnedByYou" not in str(exc):  # another migrate made it meanwhile
                raise _unavailable(exc) from exc
        return f"created the bucket {bucket}; files in s3://{bucket}/{self.location.prefix}"

    def create(self, name: str) -> Writer:
        return _S3Writer(self, self._key(name))

    def open(self, name: str, offset: int = 0) -> BinaryIO:
        args: dict[str, Any] = {"Bucket": self.location.bucket, "Key": self._key(name)}
        if offset:
            args["Range"] = f"bytes={offset}-"
        try:
            got = self.client().get_object(**args)
        except self.errors as exc:
            if _not_found(exc):
                raise FileNotFoundError(name) from exc
            if offset and _code(exc) == "InvalidRange":  # from the end on: nothing left
                self._size(name)  # FileNotFoundError if there is no such file
                return io.BytesIO(b"")
            raise _unavailable(exc) from exc
        return io.BufferedReader(_S3Body(got["Body"]), buffer_size=READ_BUFFER)

    def _size(self, name: str) -> int:
        try:
            head = self.client().head_object(Bucket=self.location.bucket, Key=self._key(name))
        except self.errors as exc:
            if _not_found(exc):
                raise FileNotFoundError(name) from exc
            raise _unavailable(exc) from exc
        return int(head["ContentLength"])

    def exists(self, name: str) -> bool:
        try:
            self._size(name)
        except FileNotFoundError:
            return False
        return True

    def delete(self, names: Iterable[str]) -> None:
        keys = [{"Key": self._key(name)} for name in names]
        for start in range(0, len(keys), DELETE_PAGE):
            try:
                got = self.client().delete_objects(
                    Bucket=self.location.bucket,
                    Delete={"Objects": keys[start : start + DELETE_PAGE], "Quiet": True},
                )
            except self.errors as exc:
                raise _unavailable(exc) from exc
            # Quiet: a 200 that lists only the keys it could not delete (AccessDenied...).
            failed = [e for e in got.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                first = failed[0]
                raise StoreUnavailable(
                    f"the object store kept {len(failed)} of the files to delete "
                    f"({first.get('Key')}: {first.get('Code')} {first.get('Message')})",
                    [str(e.get("Key", ""))[len(self.location.prefix) :] for e in failed],
                )

    def committed_before(self, cutoff: float) -> list[str]:
        names: list[str] = []
        pages = self.client().get_paginator("list_objects_v2")
        try:
            for page in pages.paginate(Bucket=self.location.bucket, Prefix=self._key("file_")):
                for item in page.get("Contents", []):
                    if item["LastModified"].timestamp() <= cutoff:
                        names.append(str(item["Key"])[len(self.location.prefix) :])
        except self.errors as exc:
            raise _unavailable(exc) from exc
        return names

    def remove_incomplete(self, cutoff: float) -> list[str]:
        client, bucket = self.client(), self.location.bucket
        removed: list[str] = []
        try:
            pages = client.get_paginator("list_multipart_uploads")
            # Only tierq's own: another application's uploads in the bucket are its own.
            for page in pages.paginate(Bucket=bucket, Prefix=self._key("file_")):
                for upload in page.get("Uploads", []):
                    key, upload_id = str(upload["Key"]), str(upload["UploadId"])
                    try:
                        if self._last_touched(key, upload_id, upload["Initiated"]) > cutoff:
                            continue
                        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
                    except self.errors as exc:
                        if _not_found(exc):  # completed or aborted meanwhile
                            continue
                        raise
                    removed.append(key[len(self.location.prefix) :])
        except self.errors as exc:
            raise _unavailable(exc) from exc
        return removed

    def _last_touched(self, key: str, upload_id: str, initiated: datetime) -> float:
        """When the upload last grew: its latest part, else its start."""
        latest = initiated.timestamp()
        pages = self.client().get_paginator("list_parts")
        for page in pages.paginate(Bucket=self.location.bucket, Key=key, UploadId=upload_id):
            for part in page.get("Parts", []):
                latest = max(latest, part["LastModified"].timestamp())
        return latest


_stores: dict[tuple[str | None, Path], FileStore] = {}
_stores_lock = threading.Lock()


class _Where(Protocol):  # tierq.core.settings.Settings, which imports this module
    @property
    def files_url(self) -> str | None: ...

    @property
    def resolved_files_dir(self) -> Path: ...


def file_store(settings: _Where) -> FileStore:
    """This process's store for these settings (one client, made once)."""
    key = (settings.files_url, settings.resolved_files_dir)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            if settings.files_url:
                store = S3Store(S3Location.parse(settings.files_url))
            else:
                store = LocalStore(settings.resolved_files_dir)
            _stores[key] = store
        return store
