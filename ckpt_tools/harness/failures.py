"""A failed rank of a multi-process run, told in one line: which rank, and its own error.

A spawned rank runs in a process of its own, so its exception cannot reach the launcher as
an object. Each failing rank writes a summary (:func:`write_failure`: the error's class,
its words for Python and for the command line, its exit code) into the launcher's scratch
folder, and the launcher turns the one that explains the failure into a
:class:`RankFailedError` (:func:`rank_failure`), which the ``ckpt`` boundary prints as one
line with the rank's own exit code. A rank that only lost its peers (a collective that
broke because another rank died) says so (:class:`PeerLostError`) and is the explanation
only when no rank has a better one; a rank killed by a signal is named with the signal.
An error of the harness itself (a bug) stays a ``RuntimeError`` carrying its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ckpt_tools.errors import EXIT_OUTPUT, EXIT_USAGE, CheckpointError, Remedy, ResourceLimitError

__all__ = [
    "PeerLostError",
    "RankFailedError",
    "join_group",
    "peer_lost",
    "port_taken",
    "ports_taken_error",
    "quiet_spawn_log",
    "rank_failure",
    "stop_ranks",
    "write_failure",
]

#: The system errors that mean an output could not be written: exit 6, as ``ckpt``'s
#: boundary reports such an error of a one-process command; any other OSError is exit 2.
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
#: A lost peer is a consequence, not a cause: exit 1, the code of a failed run, where the
#: failing rank's own error carries its code.
EXIT_PEER_LOST = 1
# How gloo's transport reports a peer that went away (a plain RuntimeError); nccl raises
# torch.distributed's DistBackendError.
_GLOO_PEER_GONE = re.compile(r"gloo/transport/|Connection (closed|reset) by peer")


class RankFailedError(CheckpointError):
    """A rank of a multi-process run (``ddp``, ``fsdp``, ``zero``) failed or was killed.

    Args:
        message: the rank's error in Python terms (``batch_size=1: ...``).
        rank: the rank.
        world: the number of ranks.
        exit_code: the exit code of the rank's own error; 128 + N for a signal N.
        error: the class name of the rank's error (``NotADirectoryError``), or ``""``.
        cli_message: the same error in command-line terms (``--batch-size 1: ...``).
        signal_name: the signal that killed the rank (``SIGKILL``), or None.

    Example:
        >>> err = RankFailedError("Not a directory: 'f/sub'", rank=0, world=2, exit_code=2,
        ...                       error="NotADirectoryError")
        >>> err.render(for_cli=True), err.exit_code
        ("rank 0 of 2 failed: Not a directory: 'f/sub'", 2)
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        world: int,
        exit_code: int,
        error: str = "",
        cli_message: str | None = None,
        signal_name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank, self.world, self.exit_code = rank, world, exit_code
        self.error, self.signal_name = error, signal_name
        self.cli_message = message if cli_message is None else cli_message

    def render(self, *, for_cli: bool = False) -> str:
        """``rank R of N failed: <the rank's error>`` (or ``was killed by SIGNAL``)."""
        text = self.cli_message if for_cli else self.message
        if self.signal_name is not None:
            return f"rank {self.rank} of {self.world} {text}"
        return f"rank {self.rank} of {self.world} failed: {text}"


class PeerLostError(RankFailedError):
    """A collective of one rank broke: another rank most likely failed or was killed.

    Raised by the rank itself (``torch.distributed``'s ``DistError`` turned into one line),
    so that under ``torchrun`` the ranks that only lost their peers print one line each,
    while the rank that failed first prints its own error. Exit 1.

    Args:
        rank: this rank.
        world: the number of ranks.
        cause: what ``torch.distributed`` raised; its first line is kept in the message.

    Example:
        >>> gloo = "[pair.cc:553] Connection closed by peer [::1]:5. This is typically ..."
        >>> PeerLostError(1, 2, RuntimeError(gloo)).render()
        'rank 1 of 2 failed: lost the other ranks (...): Connection closed by peer [::1]:5'
    """

    def __init__(self, rank: int, world: int, cause: BaseException) -> None:
        super().__init__(
            f"lost the other ranks (did one fail? its own error says why): {_news(cause)}",
            rank=rank,
            world=world,
            exit_code=EXIT_PEER_LOST,
            error=type(cause).__name__,
        )


def _news(cause: BaseException, *, advice: bool = False) -> str:
    """The first line of a torch.distributed error, less gloo's source location (and the
    advice after its first sentence, unless ``advice``)."""
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)
    return first if advice else first.split(". ")[0]


def join_group(backend: str, init_method: str, rank: int, world: int, timeout: Any) -> None:
    """``dist.init_process_group``, a failure said in one line: the machine's set-up (a
    ``GLOO_SOCKET_IFNAME`` naming no interface), not a fault of the harness. A port another
    process took stays as raised: the launcher retries on another (:func:`port_taken`).

    Raises:
        RankFailedError: the rank could not join the others (exit 2).
    """
    import torch.distributed as dist

    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
        )
    except RuntimeError as exc:
        if "address already in use" in str(exc).lower():
            raise
        raise RankFailedError(
            f"could not join the other ranks over {backend}: {_news(exc, advice=True)}",
            rank=rank,
            world=world,
            exit_code=EXIT_USAGE,
            error=type(exc).__name__,
        ) from exc


def peer_lost(exc: BaseException) -> bool:
    """Whether a collective failed because the connection to another rank broke.

    Args:
        exc: what a rank's training or barrier raised.

    Returns:
        True for ``torch.distributed``'s ``DistError`` (nccl, the rendezvous store) and for
        gloo's "Connection closed by peer"; False for anything else, which stays as raised.

    Example:
        >>> peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
        True
    """
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or bool(_GLOO_PEER_GONE.search(str(exc)))


@contextlib.contextmanager
def quiet_spawn_log() -> Iterator[None]:
    """Keep torch's "Terminating process ..." warnings off stderr while ranks are joined.

    Once one rank failed, ``torch.multiprocessing`` ends the others and logs each; the failed
    rank's error is the one line the command prints.

    Example:
        >>> with quiet_spawn_log():
        ...     logging.getLogger("torch.multiprocessing.spawn").warning("not shown")
    """
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")

    def drop(record: logging.LogRecord) -> bool:
        return False

    spawn_log.addFilter(drop)
    try:
        yield
    finally:
        spawn_log.removeFilter(drop)


def write_failure(folder: str | Path, rank: int, exc: BaseException) -> Path:
    """Record why ``rank`` failed, for the launcher's :func:`rank_failure` to read.

    Args:
        folder: the launcher's scratch folder, shared by every rank.
        rank: the failing rank.
        exc: its error.

    Returns:
        The summary's path, ``folder/rank{rank}.json``.

    Example:
        >>> path = write_failure(".", 1, NotADirectoryError(20, "Not a directory", "f/sub"))
        >>> json.loads(path.read_text())["exit_code"]
        2
    """
    summary: dict[str, Any] = {"rank": rank, "error": type(exc).__name__}
    if isinstance(exc, CheckpointError):
        kind = "peer" if isinstance(exc, PeerLostError) else "error"
        text, cli, code = str(exc), exc.render(for_cli=True), exc.exit_code
        if isinstance(exc, RankFailedError):
            text, cli = exc.message, exc.cli_message  # the launcher adds the rank again
    elif isinstance(exc, OSError):
        where = f": {os.fsdecode(exc.filename)!r}" if exc.filename is not None else ""
        kind, text = "error", f"{exc.strerror or exc}{where}"
        cli, code = text, EXIT_OUTPUT if exc.errno in OUTPUT_ERRNOS else EXIT_USAGE
    else:
        # A bug of the harness: the launcher keeps its traceback, as Python would print it.
        text = "".join(traceback.format_exception(exc))
        kind, cli, code = "bug", text, 1
    summary.update(kind=kind, message=text, cli=cli, exit_code=code)
    path = Path(folder) / f"rank{rank}.json"
    path.write_text(json.dumps(summary), encoding="utf-8")
    return path


def _read_failures(folder: str | Path) -> list[dict[str, Any]]:
    found = []
    for path in Path(folder).glob("rank*.json"):
        try:
            found.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue  # a rank killed while writing it: its exit code still tells
    return sorted(found, key=lambda summary: summary["rank"])


def port_taken(folder: str | Path, exc: BaseException) -> bool:
    """Whether a spawned run failed because another process took its rendezvous port before
    rank 0 bound it (the launcher then retries on another port): told by the launcher's
    error, or by a rank's summary where that rank's exit aborted after it (SIGABRT).

    Example:
        >>> port_taken(".", RuntimeError("process 0 terminated with signal SIGABRT"))
        False
    """
    texts = [str(exc), *(summary["message"] for summary in _read_failures(folder))]
    return any("address already in use" in text.lower() for text in texts)


def ports_taken_error(tries: int) -> ResourceLimitError:
    """The error for a spawned run whose rendezvous port another process took on every try.

    Example:
        >>> err = ports_taken_error(3)
        >>> err.exit_code, str(err).endswith("each of 3 times; run it again")
        (5, True)
    """
    return ResourceLimitError(
        f"the ranks could not meet: another process took the rendezvous port on 127.0.0.1 "
        f"each of {tries} times",
        remedies=(Remedy(text="run it again"),),
    )


def rank_failure(
    folder: str | Path, world: int, exit_codes: Sequence[int | None], first: int, what: str
) -> Exception:
    """The error that explains a failed multi-process run, from what its ranks left.

    In order of preference: a rank's own error (the lowest such rank), a rank killed by a
    signal, a rank's bug (a ``RuntimeError`` with its traceback), a rank that lost its
    peers. A rank that wrote why it failed is told by that, whatever its exit: the
    interpreter's own exit can still abort on gloo's threads (SIGABRT) after the summary.

    Args:
        folder: where the ranks wrote :func:`write_failure` summaries.
        world: the number of ranks.
        exit_codes: every rank's process exit code (negative: killed by that signal).
        first: the rank whose exit the launcher saw first; the launcher ended the others
            with SIGTERM after it, so only that rank's SIGTERM is someone else's.
        what: the strategy, for a bug's message (``"DDP"``).

    Returns:
        A :class:`RankFailedError`, or a ``RuntimeError`` for a bug or an unexplained exit.

    Example:
        >>> rank_failure(".", 2, [0, -9], 1, "DDP").render(for_cli=True)
        'rank 1 of 2 was killed by signal SIGKILL (9)'
    """
    summaries = _read_failures(folder)
    by_kind = {kind: [s for s in summaries if s["kind"] == kind] for kind in ("error", "bug")}
    if by_kind["error"]:
        return _from_summary(by_kind["error"][0], world)
    summarized = {s["rank"] for s in summaries}
    for rank, code in enumerate(exit_codes):
        if rank in summarized or code is None or code >= 0:
            continue
        if code != -signal.SIGTERM or rank == first:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
            # The launcher SIGKILLs a rank still alive 30 s after its SIGTERM (a stopped or
            # hung one): said with what the rank that stopped first said.
            after = next((s for s in summaries if s["rank"] == first), None)
            late = code == -signal.SIGKILL and rank != first and after is not None
            why = f", after rank {first} stopped: {after['message']}" if late else ""
            return RankFailedError(
                f"was killed by signal {name} ({-code}){why}",
                rank=rank,
                world=world,
                exit_code=128 - code,
                signal_name=name,
            )
    if by_kind["bug"]:
        bug = by_kind["bug"][0]
        head = f"a {what} worker process (rank {bug['rank']}) failed"
        return RuntimeError(f"{head}:\n{bug['message']}")
    if summaries:
        return _from_summary(summaries[0], world)
    code = exit_codes[first]
    return RuntimeError(f"a {what} worker process (rank {first}) exited with code {code}")


def _from_summary(summary: dict[str, Any], world: int) -> RankFailedError:
    return RankFailedError(
        summary["message"],
        rank=summary["rank"],
        world=world,
        exit_code=summary["exit_code"],
        error=summary["error"],
        cli_message=summary["cli"],
    )


def stop_ranks(processes: Sequence[Any]) -> None:
    """End every rank still running (SIGTERM, then SIGKILL after a few seconds), and reap it."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
