"""The check pool: correctness checks (and with them the Triton compilations) in worker processes.

Each worker is a spawned process that runs one task at a time; the run gives each task a time limit.
A task that fails (a compile error, out of resources) returns its error; one that passes its limit
has its worker killed and replaced. Either way the task's verdict is handed back at once (the caller
records it as it comes), and the pool goes on. Workers compile into Triton's on-disk cache, so the
timings in the main process afterwards load the compiled kernels instead of compiling them.
"""

from __future__ import annotations

import importlib
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from benchmarks.gpu.record import Run, first_line, release_gpu_cache

#: A task: ``("package.module:function", args)``; the function returns a JSON-able dict.
Task = tuple[str, tuple]


def call(task: Task) -> dict:
    """Run a task here (in a worker, or in the main process for a test)."""
    target, args = task
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)(*args)


def _worker(conn) -> None:
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the run has gone
            return
        if task is None:
            return
        try:
            result = call(task)
        except Exception as error:  # the verdict is the error
            result = {"ok": False, "error": first_line(error)}
        release_gpu_cache()  # a worker holds no memory between tasks: the others share the device
        conn.send(result)


class _Slot:
    """One worker process and the task it runs."""

    def __init__(self, context):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.index: int | None = None
        self.began = 0.0

    def give(self, index: int, task: Task) -> None:
        self.conn.send(task)
        self.index, self.began = index, time.monotonic()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


def run_pool(
    run: Run,
    tasks: list[Task],
    jobs: int,
    task_limit_s: float,
    on_result: Callable[[int, dict], None],
) -> list[int]:
    """Run ``tasks`` on ``jobs`` workers; ``on_result(index, verdict)`` as each finishes (a verdict is
    ``{"ok": False, "error": "Timeout: ..."}`` for a task past ``task_limit_s``). Stops when the budget is
    spent (an :class:`~benchmarks.gpu.record.Overrun` of an enclosing limit also ends it); returns the
    indices of the tasks without a verdict (never started, or cut off by the budget)."""
    context = multiprocessing.get_context("spawn")
    todo = list(range(len(tasks)))
    slots = [_Slot(context) for _ in range(max(1, min(jobs, len(tasks))))]
    for slot in slots:
        run.children.add(slot.process.pid)
    try:
        while todo or any(s.index is not None for s in slots):
            for slot in slots:
                if slot.index is None and todo:
                    index = todo.pop(0)
                    slot.give(index, tasks[index])
            busy = [s for s in slots if s.index is not None]
            soonest = min(s.began + task_limit_s for s in busy)
            ready = wait([s.conn for s in busy], timeout=max(min(soonest - time.monotonic(), run.left()), 0))
            if not ready and run.left() <= 0:
                break
            for i, slot in enumerate(slots):
                if slot.index is None:
                    continue
                if slot.conn in ready:
                    verdict = slot.conn.recv()
                elif time.monotonic() - slot.began >= task_limit_s:
                    verdict = {"ok": False, "error": f"Timeout: not done in {task_limit_s:.0f} s; worker killed"}
                    run.children.discard(slot.process.pid)
                    slot.kill()
                    slots[i] = _Slot(context)
                    run.children.add(slots[i].process.pid)
                else:
                    continue
                index, slot.index = slot.index, None
                on_result(index, verdict)
        return todo + [s.index for s in slots if s.index is not None]
    finally:
        for slot in slots:
            run.children.discard(slot.process.pid)
            slot.kill()
