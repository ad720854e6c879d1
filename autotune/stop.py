"""A stop request (SIGTERM, Ctrl-C) that is not lost where Python swallows the KeyboardInterrupt.

The handler raises ``KeyboardInterrupt`` where the main thread happens to be. When that is a
weakref callback or a ``__del__`` run by the garbage collector, Python prints "Exception
ignored in ..." and goes on: the search would finish as if nobody had asked it to stop. The
handler also records the request, and the places that wait (for a worker, between trials)
call :func:`check`, which raises it again.
"""

from __future__ import annotations

import signal

_requested = False


def request(signum=None, frame=None) -> None:
    """The signal handler: remember the request, then interrupt whatever runs now."""
    global _requested
    _requested = True
    raise KeyboardInterrupt


def requested() -> bool:
    return _requested


def check() -> None:
    """Raise the stop request again if it was made (and perhaps swallowed)."""
    if _requested:
        raise KeyboardInterrupt


def install() -> None:
    """`kill` and Ctrl-C stop a search alike: the trial in flight is recorded, outputs written."""
    global _requested
    _requested = False
    signal.signal(signal.SIGTERM, request)
    signal.signal(signal.SIGINT, request)
