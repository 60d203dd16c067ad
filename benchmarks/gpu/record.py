"""The run's records and its deadlines.

Every record is one JSON line written with a single ``os.write`` on a file opened for appending, so
a run killed at any moment leaves only whole lines. Time is bounded at three levels:

* a **limit** (:meth:`Run.limit`) around each measurement or compilation: an interval timer raises
  :class:`Overrun` in the main thread when it passes, the measurement is recorded as cut off and
  the run goes on;
* a **section deadline**: each section runs inside a limit of its own;
* the **hard end** (the budget plus :data:`HARD_GRACE_S`): a watchdog thread, for what a timer cannot
  interrupt (native code that never returns to Python), writes the closing record, kills the
  processes the run started and ends the process with status 0.

The closing record (``kind: "end"``) names the sections run, cut off and not reached.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

#: Seconds past the budget at which the watchdog ends the run, whatever runs then.
HARD_GRACE_S = 20.0
#: Seconds kept back from a section's deadline for its own records after a cut-off.
RECORD_RESERVE_S = 1.0


class Overrun(Exception):
    """A limit passed: raised in the main thread by the interval timer.

    Args:
        what: the measurement or section the limit was set for.
        token: identifies the limit, so that only its own ``limit`` block treats it as its own.
    """

    def __init__(self, what: str, token: int):
        super().__init__(f"{what}: cut off at its deadline")
        self.what, self.token = what, token


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` (200 characters at most)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


class Run:
    """The record file, the time budget and the versions every record carries.

    Args:
        path: the record file (appended to).
        budget_s: seconds from ``started`` to the end of the last section.
        versions: fields every record carries (device, torch, triton).
        started: ``time.monotonic()`` when the process started (default: now).
        smoke: the CPU rehearsal (tiny shapes, Triton's interpreter).
        hard_grace_s: seconds past the budget at which the watchdog ends the process.
    """

    def __init__(
        self,
        path: Path,
        budget_s: float,
        versions: dict,
        started: float | None = None,
        smoke: bool = False,
        hard_grace_s: float = HARD_GRACE_S,
    ):
        self.start = time.monotonic() if started is None else started
        self.budget_s, self.versions, self.smoke = budget_s, versions, smoke
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.out_dir = path.parent
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._limits: dict[int, tuple[float, str]] = {}  # token -> (monotonic deadline, what)
        self._active: list[int] = []  # tokens of the limits entered, outermost first
        self.fired: dict[int, str] = {}  # token -> what, for each limit whose timer has gone off
        self._tokens = itertools.count()
        self.children: set[int] = set()  # processes (and groups) to kill at the hard end
        self.done: list[str] = []  # sections finished
        self.cut: list[str] = []  # sections cut off at their deadline
        self.pending: list[str] = []  # sections not yet started
        self.current: str | None = None
        self.closed = False
        self.state: dict = {}  # what a section leaves for a later one (tuned tiles, step records)
        signal.signal(signal.SIGALRM, self._alarm)
        hard_end = self.start + budget_s + hard_grace_s
        self._watchdog = threading.Thread(target=self._watch, args=(hard_end,), daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------ records

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.budget_s - self.elapsed()

    def emit(self, **record) -> dict:
        """Append one record (with the versions and the elapsed seconds) and print a short form."""
        record = {**self.versions, "elapsed_s": round(self.elapsed(), 1), **record}
        line = (json.dumps(record, default=str) + "\n").encode()
        if self._lock.acquire(timeout=5):  # the watchdog must not wait on a writer that hangs
            try:
                os.write(self._fd, line)
            finally:
                self._lock.release()
        brief = {k: v for k, v in record.items() if k not in self.versions and k != "table" and v is not None}
        print(json.dumps(brief, default=str)[:300], flush=True)
        return record

    def close(self, reason: str = "finished") -> None:
        """The closing record: what ran, what was cut off, what was not reached."""
        if self.closed:
            return
        self.closed = True
        self.emit(
            kind="end",
            reason=reason,
            done=self.done,
            cut_off=self.cut + ([self.current] if self.current and reason != "finished" else []),
            not_reached=self.pending,
            budget_s=self.budget_s,
        )

    # ------------------------------------------------------------------ deadlines

    def _arm(self) -> None:
        """Point the interval timer at the nearest active deadline (or stop it)."""
        if not self._limits:
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        nearest = min(deadline for deadline, _ in self._limits.values())
        signal.setitimer(signal.ITIMER_REAL, max(nearest - time.monotonic(), 1e-3))

    def _alarm(self, signum, frame) -> None:
        token, (_, what) = min(self._limits.items(), key=lambda item: item[1][0], default=(None, (0, "")))
        if token is None:
            return
        del self._limits[token]  # raised once; outer limits stay armed
        self.fired[token] = what
        self._arm()
        raise Overrun(what, token)

    @contextlib.contextmanager
    def limit(self, seconds: float, what: str) -> Iterator[int]:
        """Raise :class:`Overrun` in the block after ``seconds`` (never past the budget's end); yields
        the limit's token, which :meth:`attempt` compares to tell its own overrun from an outer one."""
        deadline = time.monotonic() + max(min(seconds, self.left()), 1e-3)
        token = next(self._tokens)
        self._limits[token] = (deadline, what)
        self._active.append(token)
        self._arm()
        try:
            yield token
        finally:
            self._limits.pop(token, None)
            self._active.remove(token)
            self._arm()

    def raise_outer(self, own: int) -> None:
        """Raise the overrun of a limit around ``own`` that went off while library code caught it (a
        compiler that wraps every exception), so that the section still ends at its deadline."""
        for token in self._active:
            if token != own and token in self.fired:
                raise Overrun(self.fired[token], token)

    def attempt(self, what: str, seconds: float, measure: Callable[[], dict]) -> dict:
        """``measure()`` under a limit of ``seconds``; an error or its own overrun becomes ``{"error": ...}``
        (an outer limit's overrun goes on up)."""
        began = time.monotonic()
        with self.limit(seconds, what) as token:
            try:
                return measure()
            except Overrun as overrun:
                if overrun.token != token:
                    raise
                return {"error": f"Overrun: not done in {time.monotonic() - began:.0f} s (limit {seconds:.0f} s)"}
            except Exception as error:  # one measurement failing must not cost the rest
                self.raise_outer(token)
                if token in self.fired:  # its own overrun, wrapped by the library it interrupted
                    return {"error": f"Overrun: not done in {time.monotonic() - began:.0f} s (limit {seconds:.0f} s)"}
                missing = {"missing_package": error.name} if isinstance(error, ImportError) else {}
                return {"error": first_line(error), **missing}

    def _watch(self, hard_end: float) -> None:
        while time.monotonic() < hard_end:
            time.sleep(min(0.5, max(hard_end - time.monotonic(), 0)))
            if self.closed:
                return
        self.kill_children()
        self.close(reason=f"hard end: the budget plus {HARD_GRACE_S:.0f} s passed inside {self.current}")
        os._exit(0)

    # ------------------------------------------------------------------ processes

    def kill_children(self) -> None:
        """Kill the processes the run started: each subprocess's group, each pool worker."""
        for pid in list(self.children):
            for kill in (os.killpg, os.kill):  # a subprocess leads its group; a pool worker does not
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)
        self.children.clear()

    def process(self, command: list[str], timeout: float, log: Path | None = None, **popen) -> tuple[int | None, str]:
        """Run ``command`` in a process group of its own for at most ``timeout`` seconds (and never past
        the budget), then kill the group; the exit status (None: killed) and the output, whose last 200
        lines are appended to ``log``."""
        timeout = max(min(timeout, self.left()), 1.0)
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            **popen,
        )
        self.children.add(child.pid)
        status: int | None = None
        output = ""
        try:
            output, _ = child.communicate(timeout=timeout)
            status = child.returncode
        except subprocess.TimeoutExpired:
            pass
        finally:  # also on an Overrun: the group goes with the measurement
            if status is None:
                with contextlib.suppress(OSError):
                    os.killpg(child.pid, signal.SIGKILL)
                output = (output or "") + (child.communicate()[0] or "")
            self.children.discard(child.pid)
            if log is not None:
                with log.open("a") as sink:
                    sink.write(f"$ {' '.join(command)}\n" + "\n".join(output.splitlines()[-200:]) + "\n\n")
        return status, output


def release_gpu_cache() -> None:
    """Hand the CUDA allocator's cached blocks back to the device, so that the check pool's workers
    (processes of their own) find the memory that a finished section held (tens of GiB after the
    cross-entropy at the LM's vocabulary)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
