"""Output of child processes: lines and carriage-return progress bars, read as bytes."""

from __future__ import annotations

import io

import pytest

from supervisor.docker.process import Tail, _pump, segments

BAR = "model.safetensors:  40%|####      | 42.4G/106G [00:00<00:00]"


@pytest.mark.parametrize(
    ("data", "found", "rest"),
    [
        (b"", [], b""),
        (b"half a line", [], b"half a line"),
        (b"one\ntwo\n", [("one", True), ("two", True)], b""),
        (b"windows\r\nline\r\n", [("windows", True), ("line", True)], b""),
        (b"a:  1%\ra:  2%\ra:  3", [("a:  1%", False), ("a:  2%", False)], b"a:  3"),
        (b"a: 99%\ra: 100%\n", [("a: 99%", False), ("a: 100%", True)], b""),
        (b"\r\r\n\n   \n", [], b""),  # blank segments are left out
        (b"\x1b[A\x1b[2Kbar 5%\r", [("bar 5%", False)], b""),  # tqdm's cursor moves
        (b"caf\xc3\xa9 \xff\n", [("café \ufffd", True)], b""),  # bytes, decoded leniently
        (b"end   \n", [("end", True)], b""),
    ],
)
def test_segments(data: bytes, found: list[tuple[str, bool]], rest: bytes) -> None:
    assert segments(data) == (found, rest)


@pytest.mark.parametrize(
    ("added", "lines"),
    [
        ([("a", True), ("b", True)], ["a", "b"]),
        ([("1%", False), ("2%", False), ("3%", False)], ["3%"]),
        (
            [("start", True), ("1%", False), ("100%", True), ("done", True)],
            ["start", "100%", "done"],
        ),
        ([("x 1%", False), ("x 100%", True), ("y 1%", False), ("y 9%", False)], ["x 100%", "y 9%"]),
    ],
)
def test_a_progress_bar_is_one_line_of_the_tail(
    added: list[tuple[str, bool]], lines: list[str]
) -> None:
    tail = Tail()
    for text, line in added:
        tail.add(text, line)
    assert tail.lines == lines


def test_the_tail_keeps_its_size() -> None:
    tail = Tail(3)
    for n in range(10):
        tail.add(str(n), True)
    assert tail.lines == ["7", "8", "9"]


class Chunks(io.RawIOBase):
    """A pipe that hands out its data in the given pieces, as a real one may."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    def read1(self, size: int = -1) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


@pytest.mark.parametrize(
    ("chunks", "messages", "tail"),
    [
        # a hundred redraws in one read: one message, the latest, and one line of the tail
        (
            [
                b"Fetching 3 files\n"
                + b"".join(f"model.safetensors: {p:3d}%|\r".encode() for p in range(100))
            ],
            ["Fetching 3 files", "model.safetensors:  99%|"],
            ["Fetching 3 files", "model.safetensors:  99%|"],
        ),
        # a bar cut in the middle of a read waits for its end
        ([BAR[:20].encode(), BAR[20:].encode() + b"\r", b"done\n"], [BAR, "done"], ["done"]),
        ([b"no newline at the end"], ["no newline at the end"], ["no newline at the end"]),
        (
            [b"a\n", b"b 1%\rb 50%\r", b"b 100%\r\n", b"c"],
            ["a", "b 50%", "b 100%", "c"],
            ["a", "b 100%", "c"],
        ),
    ],
)
def test_pump_reports_the_latest_segment(
    chunks: list[bytes], messages: list[str], tail: list[str]
) -> None:
    seen: list[str] = []
    kept: list[str] = []
    _pump(Chunks(chunks), seen.append, kept)  # type: ignore[arg-type]
    assert seen == messages
    assert kept == tail
