"""A TensorBoard log folder's scalars, read as TensorBoard reads them.

Event files are TFRecord files: records of ``uint64 length``, ``uint32 masked CRC-32C of the length``,
``data``, ``uint32 masked CRC-32C of the data`` (little-endian), each ``data`` an ``Event`` protobuf.
TensorBoard reads a folder's event files in name order, and an event file of version 2 or later
(``file_version: "brain.Event:2"``) that holds a ``SessionLog.START`` event at step ``S`` drops
every event read before it from step ``S`` on (its ``_CheckForRestartAndMaybePurge``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.record_writer import masked_crc32c

_HEADER = struct.Struct("<QI")  # data length, masked CRC of the length's 8 bytes
_FOOTER = struct.Struct("<I")  # masked CRC of the data


class Scalar(NamedTuple):
    """One scalar point of a TensorBoard series."""

    tag: str
    step: int
    value: float


class EventFile(NamedTuple):
    """What one event file holds: its restart markers (``SessionLog.START`` steps) and its scalars."""

    path: Path
    starts: list[int]
    scalars: list[Scalar]


def event_files(folder: str | Path) -> list[Path]:
    """The event files of ``folder``, in the order TensorBoard reads them (their names)."""
    return sorted(Path(folder).glob("events.out.tfevents.*"), key=lambda path: path.name)


def read_events(path: str | Path) -> Iterator[Event]:
    """The events of one file; a record cut short at the end (a killed writer) ends it, as in TensorBoard.

    Raises:
        AssertionError: a record's CRC does not match.
    """
    data = Path(path).read_bytes()
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, length_crc = _HEADER.unpack_from(data, offset)
        assert masked_crc32c(data[offset : offset + 8]) == length_crc, f"{path}: bad length CRC at byte {offset}"
        start, end = offset + _HEADER.size, offset + _HEADER.size + length
        if end + _FOOTER.size > len(data):
            return
        (data_crc,) = _FOOTER.unpack_from(data, end)
        assert masked_crc32c(data[start:end]) == data_crc, f"{path}: bad data CRC at byte {start}"
        event = Event()
        event.ParseFromString(data[start:end])
        yield event
        offset = end + _FOOTER.size


def read_event_file(path: str | Path) -> EventFile:
    """One file's restart markers and scalars (``simple_value`` summaries), in the order written."""
    starts, scalars = [], []
    for event in read_events(path):
        if event.HasField("session_log") and event.session_log.status == SessionLog.START:
            starts.append(event.step)
        for value in event.summary.value if event.HasField("summary") else []:
            if value.HasField("simple_value"):
                scalars.append(Scalar(value.tag, event.step, value.simple_value))
    return EventFile(Path(path), starts, scalars)


def scalar_series(folder: str | Path) -> list[Scalar]:
    """Every scalar TensorBoard shows for ``folder``: its files in name order, each ``SessionLog.START``
    at step S dropping what the files before had from step S on; sorted by tag, then step."""
    kept: list[Scalar] = []
    for path in event_files(folder):
        version = 0.0
        for event in read_events(path):
            if event.file_version.startswith("brain.Event:"):
                version = float(event.file_version.split(":")[1])
            if version >= 2 and event.HasField("session_log") and event.session_log.status == SessionLog.START:
                kept = [scalar for scalar in kept if scalar.step < event.step]
            for value in event.summary.value if event.HasField("summary") else []:
                if value.HasField("simple_value"):
                    kept.append(Scalar(value.tag, event.step, value.simple_value))
    return sorted(kept, key=lambda scalar: (scalar.tag, scalar.step))
