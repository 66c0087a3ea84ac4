"""bench/gateway_bench.py's pure parts: when a streamed answer is whole, and whose client
opens a new connection per request."""

from __future__ import annotations

import pytest

from bench.gateway_bench import error_of, fresh_paths, verdict

HEAD = b'data: {"choices":[{"index":0,"delta":{"content":"L"}}]}\n\n'
LENGTH = b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}]}\n\n'
DONE = b"data: [DONE]\n\n"
URLS = {"direct": "http://127.0.0.1:1", "gateway": "http://127.0.0.1:2"}


@pytest.mark.parametrize(
    "answer",
    [HEAD * 3 + DONE, HEAD + LENGTH + DONE],
    ids=["no finish reason (the fast upstream)", "finished for its length (llama-server)"],
)
def test_an_answer_to_its_done_is_whole(answer: bytes) -> None:
    assert verdict(answer) is None


def test_an_error_event_names_its_code_and_message() -> None:
    error = b'data: {"error":{"code":500,"message":"Context size has been exceeded."}}\n\n'
    assert verdict(HEAD + error + DONE) == "error event: 500: Context size has been exceeded."


def test_an_answer_cut_off_before_its_done_is_not_whole() -> None:
    assert verdict(HEAD * 2) == "ended before [DONE]"


def test_an_answer_that_stopped_before_its_length_is_not_whole() -> None:
    stop = LENGTH.replace(b"length", b"stop")
    assert verdict(HEAD + stop + DONE) == "finished: stop"


def test_an_error_document_is_code_and_message_without_the_url() -> None:
    document = (
        b'{"error": {"message": "engine bench did not answer: [Errno None] Can not write '
        b'request body for http://127.0.0.1:8080/v1/chat/completions", '
        b'"code": "engine_unreachable"}}'
    )
    assert error_of(document) == (
        "engine_unreachable: engine bench did not answer: [Errno None] Can not write request body"
    )
    assert error_of(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


@pytest.mark.parametrize(
    ("policy", "upstream", "fresh"),
    [
        ("auto", "llama", {"direct"}),  # llama-server closes after each streamed answer
        ("auto", "fast", set()),
        ("new", "fast", {"direct", "gateway"}),
        ("keep", "llama", set()),
    ],
)
def test_which_paths_open_a_connection_per_request(
    policy: str, upstream: str, fresh: set[str]
) -> None:
    assert fresh_paths(policy, upstream, URLS) == fresh
