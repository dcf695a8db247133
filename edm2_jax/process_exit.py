"""How an entry point's process ends (`edm2_jax.main` calls these around its mode;
`process.py` sets the process up): Orbax's background noise after a failed save or
restore kept to one line, and an exit bounded in time however many of its saver threads
still run."""
from __future__ import annotations

import logging as std_logging
import os
import sys
import threading
import time
import warnings

EXIT_GRACE_S = 30.0


def quiet_background_errors() -> None:
    """Orbax logs every save at INFO and, after a failed save or restore, each of its
    threads' errors: the error the process raises says it in one message. Sets absl's
    verbosity to WARNING, drops Orbax's and background threads' ERROR records, counts
    the 'Event loop is closed' errors of TensorStore's callbacks (reported by
    `exit_bounded`), and ignores the never-awaited writes and never-retrieved results
    (asyncio's "_GatheringFuture exception was never retrieved") a failed save leaves."""
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    logging.get_absl_logger().addFilter(_drop_orbax_noise)
    std_logging.getLogger("asyncio").addFilter(_drop_unretrieved)
    sys.excepthook, sys.unraisablehook = _quiet_excepthook, _quiet_unraisablehook
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)


def _drop_orbax_noise(record) -> bool:
    """absl log filter: Orbax's ERROR records (with their tracebacks) and any from
    background threads: the exception that reaches the user names the failure once."""
    return not (record.levelno >= 40 and (
        threading.current_thread() is not threading.main_thread()
        or f"{os.sep}orbax{os.sep}" in (record.pathname or "")))


def _drop_unretrieved(record) -> bool:
    """asyncio log filter: the futures of a failed asynchronous save, garbage-collected
    at exit with their exception unread (the error the process raised names it)."""
    return "exception was never retrieved" not in record.getMessage()


_suppressed = {"n": 0}


def _closed_loop(value) -> bool:
    return isinstance(value, RuntimeError) and "Event loop is closed" in str(value)


def _quiet_unraisablehook(unraisable) -> None:
    """sys.unraisablehook: after a failed asynchronous save or restore, TensorStore's
    callbacks try to reach Orbax's closed event loop, and each prints a traceback
    ("Event loop is closed"), hundreds of them; those are counted (`exit_bounded`
    reports them in one line), everything else is printed as usual."""
    if _closed_loop(unraisable.exc_value):
        _suppressed["n"] += 1
        return
    sys.__unraisablehook__(unraisable)


def _quiet_excepthook(kind, value, tb) -> None:
    """sys.excepthook: the same for the callbacks that report through it."""
    if _closed_loop(value):
        _suppressed["n"] += 1
        return
    sys.__excepthook__(kind, value, tb)


def exit_bounded(rc: int) -> None:
    """Bound the process's exit: a daemon watchdog ends it (`os._exit(rc)`, with one line
    naming the threads still running) if the interpreter's shutdown, which joins the
    remaining non-daemon threads (Orbax's savers), takes more than `EXIT_GRACE_S`."""
    if _suppressed["n"]:
        print(f"({_suppressed['n']} 'Event loop is closed' errors of Orbax's background "
              f"threads suppressed)", file=sys.stderr, flush=True)

    def watchdog():
        time.sleep(EXIT_GRACE_S)
        alive = [t.name for t in threading.enumerate() if not t.daemon and t.is_alive()
                 and t is not threading.main_thread()]
        print(f"abandoning {len(alive)} background thread(s) still running {EXIT_GRACE_S:.0f} s "
              f"after the end ({', '.join(alive[:3])}); exiting with status {rc}",
              file=sys.stderr, flush=True)
        os._exit(rc)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
