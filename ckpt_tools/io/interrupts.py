"""Signals while an output is written: SIGTERM and SIGHUP become an exception, raised where the
writer's cleanup runs, and none of them lands before that cleanup is armed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

__all__ = ["Interrupted", "naming", "signals_raise"]


class Interrupted(BaseException):
    """A signal arrived while an output was being written: the temp file is removed, or,
    where ``written`` names it, the output had just been given its name and is complete."""

    def __init__(self, signum: int, written: str | None = None) -> None:
        super().__init__(f"interrupted by signal {signal.Signals(signum).name}")
        self.signum = signum
        self.written = written


_RAISED = (signal.SIGTERM, signal.SIGHUP)
_HELD = (*_RAISED, signal.SIGINT)


@contextlib.contextmanager
def signals_raise() -> Iterator[Callable[[], None]]:
    """Inside, SIGTERM and SIGHUP raise :class:`Interrupted` where they would end the
    process (their default action); a handler the program installed stays in place.

    Until the yielded ``release`` is called, they and SIGINT are only noted, then raised
    again by ``release``: a temp file is created and its cleanup armed before any of them
    can interrupt. (Blocking them with ``pthread_sigmask`` would not do: the kernel hands a
    process-wide signal to any thread that does not block it, torch's among them.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    pending: list[int] = []

    def hold(signum: int, frame: object) -> None:
        pending.append(signum)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, hold) for signum in _HELD}
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        for signum in _HELD:
            old = previous[signum]
            # Only a signal that would kill the process becomes Interrupted: an ignored one
            # stays ignored (`nohup ckpt ...` must survive its SIGHUP), and a handler of the
            # program that calls us is its own (a preemption flag); the temp file is still
            # removed if that handler raises.
            ours = signum in _RAISED and old in (signal.SIG_DFL, None)
            handler = interrupt if ours else old
            if handler is not None:
                signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)  # its handler runs now, in the caller's cleanup

    try:
        yield release
    finally:
        try:
            release()
        finally:
            for signum in _RAISED:
                if previous[signum] is not None:
                    signal.signal(signum, previous[signum])


@contextlib.contextmanager
def naming(output: str, then: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Give an output its name with SIGTERM, SIGHUP and SIGINT held: it has the name or not.

    A signal that arrived meanwhile is raised once the body is done. Where the body named
    the output, ``then`` runs first (the folder's fsync, so the name stays), and the signal
    (SIGINT too) is an :class:`Interrupted` naming ``output``: the caller reports what was
    written, not that nothing was. A file named inside a folder output is not the output:
    the folder's writer raises such an ``Interrupted`` without ``written``.

    Args:
        output: the output, as the caller's messages name it.
        then: what completes a named output (run only when a signal arrived).
    """
    named = False
    try:
        with signals_raise():
            yield
            named = True
    except (Interrupted, KeyboardInterrupt) as e:
        if not named:
            raise
        then()
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        raise Interrupted(signum, written=output) from None
