"""The job's progress on its console: rich's bars on a terminal; on anything else (a pod's
log, ``> file``), where a bar would only show when each phase ends, plain lines."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

__all__ = ["LOG_INTERVAL", "Lines", "progress"]

LOG_INTERVAL = 30.0  # seconds between a task's progress lines when the console is no terminal


def progress(console: Any, show: bool):
    """Progress bars on a terminal; on any other console (a pod's log, ``> file``), where a bar
    would only show when each phase ends, plain lines (:class:`_Lines`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.progress import TimeElapsedColumn

    if console is not None and show and not console.is_terminal:
        return Lines(console)
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=console is None or not show,
    )


class Lines(contextlib.AbstractContextManager):
    """Progress as plain lines, for a console that is not a terminal: a line when a task starts
    or changes phase, when it completes, and in between at most one every ``interval`` seconds
    per task (:data:`LOG_INTERVAL`), each with the seconds since the job began."""

    def __init__(self, console: Any, interval: float = LOG_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self._console, self._interval, self._clock = console, interval, clock
        self._start = clock()
        self._tasks: list[dict] = []

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, total: int | None = None) -> int:
        self._tasks.append({"description": description, "total": total, "completed": 0,
                            "printed": -float("inf"), "shown": None})
        self._print(len(self._tasks) - 1)
        return len(self._tasks) - 1

    def update(self, task: int, *, completed: int | None = None, total: int | None = None,
               description: str | None = None) -> None:
        t = self._tasks[task]
        changed = description is not None and description != t["description"]
        for key, value in (("completed", completed), ("total", total),
                           ("description", description)):
            if value is not None:
                t[key] = value
        if changed and completed is None and total is None:  # a new phase: no count of its own
            t["total"], t["completed"] = None, 0
        done = t["total"] is not None and t["completed"] >= t["total"]
        due = self._clock() - t["printed"] >= self._interval
        if (changed or done or due) and t["shown"] != (t["description"], t["completed"]):
            self._print(task)

    def _print(self, task: int) -> None:
        t = self._tasks[task]
        now = self._clock()
        t["printed"], t["shown"] = now, (t["description"], t["completed"])
        count = "" if t["total"] is None else f" {t['completed']}/{t['total']}"
        self._console.print(f"[{now - self._start:7.0f} s] {t['description']}{count}",
                            highlight=False, markup=False, soft_wrap=True)
