"""A streaming multipart/form-data reader for uploads: the one file part goes to a sink as
its bytes arrive (nothing is spooled to a temporary file first), the other fields are kept
in memory, each bounded. Every refusal is a 400 in the OpenAI error shape.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from tierq.api.errors import APIError

FILE_FIELD = "file"


class FileSink(Protocol):
    """Where the file part's bytes go: `begin` with its name (before any byte), `write`
    each piece as it is parsed, `end` once the part is complete."""

    def begin(self, filename: str) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


@dataclass
class Form:
    """The fields besides the file, in order; whether the file part was read whole (its
    closing boundary seen)."""

    fields: list[tuple[str, str]] = field(default_factory=list)
    has_file: bool = False

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.fields if k == name), None)

    def names(self) -> set[str]:
        return {k for k, _ in self.fields}


def _refuse(message: str) -> APIError:
    return APIError(400, message, "invalid_request")


def _decode(raw: bytes, charset: str) -> str:
    """As Starlette decodes a field: in the form's charset, else as Latin-1."""
    try:
        return raw.decode(charset)
    except (UnicodeDecodeError, LookupError):
        return raw.decode("latin-1")


class _Reader:
    """python-multipart's callbacks are synchronous: file data is queued while a chunk is
    parsed and handed to the sink (awaited) before the next chunk is read, so at most one
    chunk of the body is held beyond what the sink holds."""

    def __init__(self, sink: FileSink, charset: str, max_fields: int, max_field_bytes: int):
        self.sink, self.charset = sink, charset
        self.max_fields, self.max_field_bytes = max_fields, max_field_bytes
        self.form = Form()
        self.pending: list[bytes] = []
        self.ended = False  # the file part ended in the chunk just parsed
        self._header_name = self._header_value = b""
        self._disposition = b""
        self._name = ""
        self._in_file = False
        self._file_seen = False
        self._data = bytearray()

    def on_part_begin(self) -> None:
        self._disposition, self._name, self._in_file = b"", "", False
        self._data = bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise _refuse('Every form part needs a Content-Disposition with a "name".')
        self._name = _decode(options[b"name"], self.charset)
        if b"filename" not in options:
            if len(self.form.fields) >= self.max_fields:
                raise _refuse(f"Too many form fields: at most {self.max_fields} besides the file.")
            return
        if self._name != FILE_FIELD or self._file_seen:
            raise _refuse("The form may hold one file part, named 'file'.")
        self._in_file = self._file_seen = True
        self.sink.begin(_decode(options[b"filename"], self.charset))

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.pending.append(data[start:end])
            return
        if len(self._data) + end - start > self.max_field_bytes:
            raise _refuse(f"A form field may hold at most {self.max_field_bytes} bytes.")
        self._data += data[start:end]

    def on_part_end(self) -> None:
        if self._in_file:
            self.ended = self.form.has_file = True
        else:
            self.form.fields.append((self._name, _decode(bytes(self._data), self.charset)))


async def read_form(
    content_type: str,
    body: AsyncIterator[bytes],
    sink: FileSink,
    *,
    max_fields: int,
    max_field_bytes: int,
) -> Form:
    """Parse the whole body, the file part into `sink`; 400 for a body that is not a
    well-formed form of at most `max_fields` fields of `max_field_bytes` besides the file."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise _refuse("Missing boundary in multipart.")
    charset = params.get(b"charset", b"utf-8").decode("latin-1")
    try:
        charset = codecs.lookup(charset).name
    except LookupError:
        charset = "latin-1"
    reader = _Reader(sink, charset, max_fields, max_field_bytes)
    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": reader.on_part_begin,
            "on_part_data": reader.on_part_data,
            "on_part_end": reader.on_part_end,
            "on_header_field": reader.on_header_field,
            "on_header_value": reader.on_header_value,
            "on_header_end": reader.on_header_end,
            "on_headers_finished": reader.on_headers_finished,
        },
    )
    try:
        async for chunk in body:
            parser.write(chunk)
            for data in reader.pending:
                await sink.write(data)
            reader.pending.clear()
            if reader.ended:
                reader.ended = False
                await sink.end()
        parser.finalize()
    except FormParserError:
        raise _refuse("Invalid multipart data.") from None
    if not reader.form.has_file:
        raise APIError(400, "'file' must be a file part.", "invalid_request", param="file")
    return reader.form
