"""Hang dumps: each rank publishes its last collective and source line to the store; a rank that waited
in one collective too long dumps its last collectives and names the ranks that never arrived."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_plugins._compat import default_store
from ddp_plugins.core.checks import check_number
from ddp_plugins.core.files import write_text_atomic
from ddp_plugins.core.timeline import Timeline, call_site, call_stack

__all__ = ["HangWatch"]

_KEY = "ddp_plugins/hang_watch/"


class HangWatch:
    """Name the rank that stopped, and where, while the others wait for it in a collective.

    After ``stall_after_s`` in one collective it dumps, once, the ranks that never reached it with
    the line each was last seen at, then this rank's last collectives and stack (stderr and
    ``dump_dir/hang_rank<r>.txt``).

    Args:
        timeline: the installed :class:`Timeline` whose collectives are watched.
        stall_after_s: seconds in one collective before the dump (keep it under the group's timeout).
        store: the store to publish to; the default process group's when ``None``.

    Example::

        >>> watch = HangWatch(Timeline(), stall_after_s=60)
        >>> watch.stall_after_s, watch.dumps
        (60.0, [])
        >>> # watch.start() ... watch.stop()
    """

    def __init__(
        self,
        timeline: Timeline,
        stall_after_s: float = 120.0,
        interval_s: float = 1.0,
        dump_dir: str | Path | None = None,
        store: Any = None,
    ) -> None:
        self.stall_after_s = float(check_number("stall_after_s", stall_after_s, 0.0, exclusive_minimum=True))
        self.interval_s = float(check_number("interval_s", interval_s, 0.0, exclusive_minimum=True))
        self.timeline = timeline
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.store = store
        self.dumps: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dumped_seq = 0

    def start(self) -> HangWatch:
        """Start the heartbeat thread (needs the process group)."""
        if self._thread is not None:
            return self
        if self.store is None:
            self.store = default_store()
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._stop.clear()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="ddp_plugins-hang-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval_s + 5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                record = self.timeline.in_flight
                if record is not None and record.seq != self._dumped_seq:
                    if (self.timeline.now() - record.start_ns) / 1e9 >= self.stall_after_s:
                        self._dumped_seq = record.seq
                        self._dump(record)
            except Exception:  # noqa: BLE001 - the store is gone with its host: nothing left to watch
                return

    def _beat(self) -> None:
        stack = call_stack(sys._current_frames().get(self.timeline._main), 60)
        beat = {
            "seq": self.timeline.seq,
            "site": call_site(stack),
            "innermost": "{}:{} in {}".format(*stack[0]) if stack else "?",
            "t": self.timeline.now(),
        }
        self.store.set(f"{_KEY}{self._rank}", json.dumps(beat))

    def _dump(self, record: Any) -> None:
        waited = (self.timeline.now() - record.start_ns) / 1e9
        lines = [
            f"rank {self._rank} has waited {waited:.1f} s in collective #{record.seq} ({record.op}, {record.kind},"
            f" {record.nbytes} B) called at {record.site}"
        ]
        for rank in (r for r in range(self._world) if r != self._rank):
            key = f"{_KEY}{rank}"
            beat = json.loads(self.store.get(key)) if self.store.check([key]) else None
            if beat is None:
                lines.append(f"rank {rank} never published a heartbeat: it did not start watching, or died first")
            elif beat["seq"] < record.seq:
                age = (self.timeline.now() - beat["t"]) / 1e9
                lines.append(
                    f"rank {rank} stopped at {beat['site']} (innermost frame {beat['innermost']}), last seen"
                    f" {age:.1f} s ago after its collective #{beat['seq']}: it never reached #{record.seq}"
                )
        text = self.timeline.dump("\n".join(lines))
        self.dumps.append(text)
        print(text, file=sys.stderr, flush=True)
        if self.dump_dir is not None:
            write_text_atomic(self.dump_dir / f"hang_rank{self._rank}.txt", text + "\n")
