"""Why an engine's container exited, in one status line.

The root cause its log names leads, then the exit code, then the last lines. An engine that
fails to start often prints its real error far above its last lines: vLLM's engine core raises,
and the API server then ends with "Engine core initialization failed. See root cause above."
Pure: log lines in, a message out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from supervisor.docker.spec import Container
from supervisor.engines.base import EXIT_LOG_LINES
from supervisor.protocol.documents import MAX_MESSAGE

_CAUSE_CHARS: Final = 300  # of the message's 500, so that the exit code and a last line fit
_TAIL_LINES: Final = 5
_GAP: Final = 20  # lines between two tracebacks of one failure (a re-raise, another process)
_RECENT: Final = 50  # lines after the last error, at most, for it to be why the engine exited
_FOLLOWING: Final = 2  # indented lines after an exception line that continue its text
_TRACEBACK: Final = "Traceback (most recent call last):"
# `pkg.mod.SomeError: text`, `SomeError: text` or a bare `SomeError`, after the line's prefix
_EXCEPTION: Final = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?::(?:\s.*)?)?")
_ERROR_MARK: Final = re.compile(r"(?:^|[\s\]|)])ERROR\b")  # a line a logger marks as an error


@dataclass(frozen=True)
class _Traceback:
    start: int  # the index of its "Traceback" line
    end: int  # the index of its exception line
    exception: str  # the exception line (and its continuation), without the line's prefix


def root_cause(lines: Sequence[str]) -> str | None:
    """The first error of the last failure in a log: the exception of the first traceback of the
    last run of tracebacks (a failure and its re-raises, here or in another process), else the
    first line of the last run of lines a logger marked ERROR; None when it names no error, or
    none near its end (an error it went on from is not why it exited)."""
    found = _tracebacks(lines)
    if found and len(lines) - 1 - found[-1].end <= _RECENT:
        return found[_last_run([(t.start, t.end) for t in found])].exception
    marked = [index for index, line in enumerate(lines) if _ERROR_MARK.search(line)]
    if marked and len(lines) - 1 - marked[-1] <= _RECENT:
        return lines[marked[_last_run([(i, i) for i in marked])]].strip()
    return None


def _last_run(spans: Sequence[tuple[int, int]]) -> int:
    """The index of the first span of the last run of spans (each within _GAP of the next):
    an error logged long before the last one is another failure, not its cause."""
    first = len(spans) - 1
    while first > 0 and spans[first][0] - spans[first - 1][1] <= _GAP:
        first -= 1
    return first


def _tracebacks(lines: Sequence[str]) -> list[_Traceback]:
    found: list[_Traceback] = []
    index = 0
    while index < len(lines):
        at = lines[index].find(_TRACEBACK)
        if at >= 0:
            ended = _exception(lines, index, lines[index][:at])
            if ended is not None:
                found.append(ended)
                index = ended.end
        index += 1
    return found


def _exception(lines: Sequence[str], start: int, prefix: str) -> _Traceback | None:
    """The exception line closing the traceback that starts at start: the first line with the
    traceback's prefix (a process or logger mark) that is not indented, nor a frame."""
    for index in range(start + 1, min(start + EXIT_LOG_LINES, len(lines))):
        line = lines[index]
        if not line.startswith(prefix):
            continue  # another process's line, between this traceback's
        rest = line[len(prefix) :]
        if not rest.strip() or rest[0].isspace():
            continue
        if rest.startswith(_TRACEBACK):
            return None
        if _EXCEPTION.fullmatch(rest.rstrip()):
            more = [rest.strip()]
            for following in lines[index + 1 : index + 1 + _FOLLOWING]:
                if not following.startswith(prefix) or not following[len(prefix) :][:1].isspace():
                    break
                more.append(following[len(prefix) :].strip())
            return _Traceback(start, index, " ".join(more))
    return None


def exit_message(container: Container, lines: Sequence[str] = ()) -> str:
    """The status line of an engine whose container exited: the root cause first when the log
    names one, then the exit code and the last lines; at most the message's 500 characters."""
    code = f"exited with code {container.exit_code}"
    if container.oom_killed:
        code = f"{code}: killed for using too much memory"
        return _with_tail(code, lines, MAX_MESSAGE - len(code) - 2, ": {}")
    cause = root_cause(lines)
    if cause is None:
        return _with_tail(code, lines, MAX_MESSAGE - len(code) - 2, ": {}")
    if len(cause) > _CAUSE_CHARS:
        cause = cause[: _CAUSE_CHARS - 1] + "…"
    lead = f"{cause} ({code}"
    rest = [line for line in lines if line.strip() not in (cause, "")]
    budget = MAX_MESSAGE - len(lead) - len("; last output: )")
    return _with_tail(lead, rest, budget, "; last output: {}") + ")"


def _with_tail(lead: str, lines: Sequence[str], budget: int, joint: str) -> str:
    """lead, then as many of the last lines as fit the budget (at least the last one)."""
    tail = [line.strip() for line in lines[-_TAIL_LINES:]]
    while len(tail) > 1 and len(" | ".join(tail)) > budget:
        del tail[0]
    if not tail:
        return lead
    shown = " | ".join(tail)
    if len(shown) > budget > 1:
        shown = shown[: budget - 1] + "…"
    return lead + joint.format(shown)
