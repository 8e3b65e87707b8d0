"""The output of streamed calls as it comes, for `CallOutputRequest` long-polls (`sandboxd call --stream`).

A streamed call's executor sends its chunks ahead of its reply; they are kept here, in memory only, while
the call runs and for a short while after, so a client that polls once more after the reply gets the tail.
A session with forgotten values streams nothing (`Calls` does not ask): a value split across two chunks
would pass a filter that sees one chunk at a time, and the whole result is filtered at the end anyway.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

#: how long a finished call's output stays for a last poll
KEEP_S = 60.0
#: most characters kept per stream of one call; later output is counted, not kept
MAX_CHARS = 16 * 1024 * 1024


@dataclass
class _Output:
    chunks: dict[str, list[str]] = field(default_factory=lambda: {"out": [], "err": []})
    sizes: dict[str, int] = field(default_factory=lambda: {"out": 0, "err": 0})
    running: bool = True
    finished_at: float = 0.0


class Streams:
    """Output of the streamed calls of every session, keyed by (session, call id)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._outputs: dict[tuple[str, str], _Output] = {}

    def open(self, session_id: str, call_id: str) -> _Writer:
        """Start keeping a call's output; returns what the executor channel hands chunks to."""
        now = time.monotonic()
        with self._cond:
            for key in [k for k, o in self._outputs.items() if not o.running and now - o.finished_at > KEEP_S]:
                del self._outputs[key]
            self._outputs[(session_id, call_id)] = _Output()
        return _Writer(self, (session_id, call_id))

    def _write(self, key: tuple[str, str], stream: str, text: str) -> None:
        with self._cond:
            output = self._outputs.get(key)
            if output is None or stream not in output.chunks:
                return
            room = MAX_CHARS - output.sizes[stream]
            if room > 0:
                output.chunks[stream].append(text[:room])
                output.sizes[stream] += len(text[:room])
            self._cond.notify_all()

    def close(self, session_id: str, call_id: str) -> None:
        """The call is over (nothing happens for a call that did not stream)."""
        with self._cond:
            output = self._outputs.get((session_id, call_id))
            if output is not None:
                output.running, output.finished_at = False, time.monotonic()
                self._cond.notify_all()

    def read(self, session_id: str, call_id: str, out_offset: int, err_offset: int,
             timeout_s: float) -> tuple[str, str, bool]:
        """Output after the offsets (characters), waiting up to `timeout_s` for some; and whether it still runs.

        A call not (yet) known reads as running with nothing written: the poll may come before the call."""
        deadline = time.monotonic() + timeout_s
        key = (session_id, call_id)
        with self._cond:
            while True:
                output = self._outputs.get(key)
                if output is not None:
                    out = "".join(output.chunks["out"])[out_offset:]
                    err = "".join(output.chunks["err"])[err_offset:]
                    if out or err or not output.running:
                        return out, err, output.running
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "", "", True
                self._cond.wait(remaining)


class _Writer:
    """The `on_output(stream, text)` of one call."""

    def __init__(self, streams: Streams, key: tuple[str, str]) -> None:
        self._streams, self._key = streams, key

    def write(self, stream: str, text: str) -> None:
        self._streams._write(self._key, stream, text)
