"""A stand-in vendor runtime: ``init()`` creates a "device context" the way runtimes do.

Real runtimes start worker threads and load driver libraries when a context is created; on a
host without any accelerator, this starts a worker thread and records that a context exists.
"""

import threading
import time

context_created = False


def init() -> None:
    global context_created
    if not context_created:
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        context_created = True
