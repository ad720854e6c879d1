"""Child processes that end with their search: a worker or DDP rank whose study process died exits.

Imported before torch by ``autotune.worker.serve`` and ``autotune.trial.ddp_rank`` (this package imports nothing
heavy), since the study can die while its child is still importing.
"""

from __future__ import annotations

import os
import threading
import time


def watch_parent(expected_parent: int) -> None:
    """Exit (code 3) once this process's parent is no longer ``expected_parent``: a killed search
    must not leave a worker on the GPU, nor a DDP rank waiting in a collective."""

    def watch() -> None:
        while True:
            if os.getppid() != expected_parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
