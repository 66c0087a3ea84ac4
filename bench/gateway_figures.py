"""The figures bench/gateway_bench.py prints: samples, whole answers, tables and goals.

A path's samples, whether an answer was whole, the table printed for each level, and issue
39's goals a run speaks to, each met or MISSED. Pure.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from bench.procfs import percentile

DONE: Final = b"data: [DONE]"
ERROR_EVENT: Final = re.compile(rb'^data: (\{"error".*)$', re.MULTILINE)
FINISH: Final = re.compile(rb'"finish_reason":"([^"]*)"')
URL_IN_MESSAGE: Final = re.compile(r" for https?://\S+")


@dataclass
class Samples:
    ttft: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0  # the gateway's CPU seconds over these rounds
    client: float = 0.0  # the load generator's own CPU seconds over these rounds
    failed: Counter[str] = field(default_factory=Counter)  # reason -> answers not whole

    @property
    def attempted(self) -> int:
        return len(self.total) + self.failures

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    def ms(self, values: list[float], q: float) -> float:
        return percentile(values, q) * 1000


def error_of(document: bytes) -> str:
    """Pure: an OpenAI-shaped error document as `code: message`, short (the document itself
    when it is not one)."""
    try:
        error = json.loads(document)["error"]
        text = f"{error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        text = document.decode(errors="replace")
    return URL_IN_MESSAGE.sub("", text)[:160]


def verdict(answer: bytes, stream: bool = True) -> str | None:
    """Pure: why an answer is not whole, or None when it is: a stream's `[DONE]` at its end
    and no error event; a plain answer's finish; and no finish other than `length` (its
    tokens all generated)."""
    error = ERROR_EVENT.search(answer)
    if error:
        return "error event: " + error_of(error.group(1))
    if stream and not answer.rstrip().endswith(DONE):
        return "ended before [DONE]"
    found = {reason.decode() for reason in FINISH.findall(answer)}
    if not stream and not found:
        return "no finish: " + error_of(answer)
    finishes = sorted(found - {"length"})
    return f"finished: {', '.join(finishes)}" if finishes else None


def table_of(streams: int, got: dict[str, Samples]) -> str:
    direct = got["direct"]
    rows = [
        f"{streams} stream(s), {direct.attempted} requests per path, ms:",
        f"  {'path':<11}{'ttft p50':>10}{'ttft p99':>10}{'total p50':>11}{'total p99':>11}"
        f"{'tokens/s':>11}{'vs direct':>11}{'failed':>8}",
    ]
    rate = {name: s.tokens / s.wall if s.wall else 0.0 for name, s in got.items()}
    for name, s in got.items():
        versus = rate[name] / rate["direct"] if rate["direct"] else float("nan")
        rows.append(
            f"  {name:<11}{s.ms(s.ttft, 0.5):>10.3f}{s.ms(s.ttft, 0.99):>10.3f}"
            f"{s.ms(s.total, 0.5):>11.3f}{s.ms(s.total, 0.99):>11.3f}{rate[name]:>11.0f}"
            f"{versus:>10.3f}x{s.failures:>8}"
        )
    for name, s in got.items():
        if name == "direct":
            continue
        added = [s.ms(s.ttft, q) - direct.ms(direct.ttft, q) for q in (0.5, 0.99)]
        added += [s.ms(s.total, q) - direct.ms(direct.total, q) for q in (0.5, 0.99)]
        rows.append(
            f"  {'+' + name:<11}{added[0]:>+10.3f}{added[1]:>+10.3f}{added[2]:>+11.3f}"
            f"{added[3]:>+11.3f}"
        )
    for name, s in got.items():
        if s.cpu:
            rows.append(
                f"  {name} CPU: {s.cpu / s.attempted * 1e6:.0f} µs per request, "
                f"{s.cpu / max(1, s.tokens) * 1e6:.1f} µs per token"
            )
    rows.append(
        "  client CPU per request: "
        + ", ".join(f"{name} {s.client / s.attempted * 1e6:.0f} µs" for name, s in got.items())
    )
    for name, s in got.items():
        for reason, count in s.failed.most_common():
            rows.append(f"  {name} failed {count} of {s.attempted}: {reason}")
    return "\n".join(rows) + "\n"


def rate(s: Samples) -> float:
    return s.tokens / s.wall if s.wall else float("nan")


def added(got: dict[str, Samples], name: str, q: float, what: str = "total") -> float:
    """ms that path `name` adds to the direct path's percentile `q` of `what`."""
    path, direct = got[name], got["direct"]
    return path.ms(getattr(path, what), q) - direct.ms(getattr(direct, what), q)


def goals(
    results: dict[int, dict[str, Samples]], *, paced: bool, upstream: str, plain: bool
) -> list[str]:
    """Pure: the issue's goals this run's figures speak to, each met or MISSED."""
    lines = []

    def goal(text: str, met: bool) -> None:
        lines.append(f"{text}: {'met' if met else 'MISSED'}")

    one = results.get(1)
    if one is not None and upstream == "fast" and not paced:
        p50, p99 = added(one, "gateway", 0.5), added(one, "gateway", 0.99)
        goal(f"1 stream, added to the whole answer, p50: {p50:+.3f} ms (goal < +0.5 ms)", p50 < 0.5)
        goal(f"1 stream, added, p99: {p99:+.3f} ms (goal < +2 ms)", p99 < 2.0)
    many = results.get(64)
    if many is not None and upstream == "fast" and not plain:
        ratio = rate(many["gateway"]) / rate(many["direct"])
        if paced:
            goal(f"64 paced streams: {ratio:.3f}x direct tokens/s (goal >= 0.97x)", ratio >= 0.97)
        else:
            floor = rate(many["floor"]) / rate(many["direct"]) if "floor" in many else None
            above = floor is None or ratio > floor
            versus = f", the floor proxy {floor:.3f}x" if floor is not None else ""
            goal(
                f"64 unpaced streams: {ratio:.3f}x direct tokens/s{versus} (goal >= 0.8x and "
                f"above the floor)",
                ratio >= 0.8 and above,
            )
            g = many["gateway"]
            per_token = g.cpu / max(1, g.tokens) * 1e6
            goal(
                f"64 unpaced streams: gateway CPU {per_token:.1f} µs per token (goal < 8)",
                per_token < 8,
            )
    sixteen = results.get(16)
    if sixteen is not None and upstream == "llama" and not plain:
        first = added(sixteen, "gateway", 0.5, "ttft")
        goal(
            f"llama-server, 16 streams, added to the first token, p50: {first:+.3f} ms "
            "(goal < +5 ms)",
            first < 5.0,
        )
    for streams, got in results.items():
        if "litellm" not in got:
            continue
        ours, theirs = added(got, "gateway", 0.5), added(got, "litellm", 0.5)
        ratio = ours / theirs if theirs > 0 else float("nan")
        kind = "plain chat" if plain else "streamed"
        goal(
            f"{streams} stream(s), {kind}, added p50: gateway {ours:+.3f} ms, LiteLLM "
            f"{theirs:+.3f} ms: {ratio:.3f}x (goal <= 0.03x)",
            ratio <= 0.03,
        )
    for streams, got in results.items():
        for name, s in got.items():
            if s.failures:
                lines.append(
                    f"{streams} stream(s): {name} failed {s.failures} of {s.attempted} requests "
                    f"({s.failures / s.attempted:.1%}), left out of its times"
                )
    return lines
