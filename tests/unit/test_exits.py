"""Why an engine exited, from its log: the root cause found in real failure output, and the one
status line made of it. The excerpts are real container logs (vLLM 0.32.0 on the CPU image,
llama-server), with most frame lines cut."""

from __future__ import annotations

import pytest

from supervisor.docker.spec import Container
from supervisor.protocol.documents import MAX_MESSAGE, clean_message
from supervisor.worker import actions
from supervisor.worker.exits import exit_message, root_cause

W = "(Worker pid=36) ERROR 12-02 04:31:13 [multiproc_executor.py:1063] "
C = "(EngineCore pid=25) ERROR 12-02 04:31:13 [core.py:1510] "
TIER = (
    "lucia_kv.tier.TierError: /kv/nvme has owner 1001 and mode 0700; it must be owned by "
    "uid 0 with mode 0700"
)
LAST = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
)
# the tier directory owned by another uid: the worker process raises, the engine core and the
# API server re-raise, and the log ends 150 lines below the cause
TIER_OWNER = (
    "(Worker pid=36) INFO 12-02 04:31:13 [factory.py:62] Creating v1 connector with name: "
    "LuciaTierConnector and engine_id: 1696da21-35f0-497d-9c43-a2d2169e8feb",
    W + "WorkerProc hit an exception.",
    W + "Traceback (most recent call last):",
    W + '  File "/opt/lucia/lucia_kv/tier.py", line 67, in _open_directory',
    W + "    raise TierError(",
    W + TIER,
    W + "Traceback (most recent call last):",
    W + '  File "/opt/lucia/lucia_kv/tier.py", line 67, in _open_directory',
    W + "    raise TierError(",
    W + TIER,
    W,
    C + "EngineCore failed to start.",
    C + "Traceback (most recent call last):",
    C + '  File "/opt/vllm/site-packages/vllm/v1/engine/core.py", line 1482, in run_engine_core',
    C + "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)",
    C + "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    C + "RuntimeError: Worker failed with error '/kv/nvme has owner 1001 and mode 0700; it must "
    "be owned by uid 0 with mode 0700', please check the stack trace above for the root cause",
    "(EngineCore pid=25) ERROR 12-02 04:31:21 [multiproc_executor.py:315] Worker proc "
    "VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.",
    "Process EngineCore:",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap',
    "    self.run()",
    "RuntimeError: Worker failed with error '/kv/nvme has owner 1001 and mode 0700; it must be "
    "owned by uid 0 with mode 0700', please check the stack trace above for the root cause",
    "(APIServer pid=1) INFO 12-02 04:31:29 [utils.py:628] [shutdown] Process manager: send "
    "sigterm to process EngineCore",
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    '  File "/opt/vllm/site-packages/vllm/v1/engine/utils.py", line 1431, in '
    "wait_for_engine_startup",
    "    raise RuntimeError(",
    LAST,
)
SHM = (
    "RuntimeError: Insufficient space in /dev/shm for shared-memory allocation: 160 MiB "
    "required, 64 MiB free. Increase /dev/shm (e.g. --shm-size or --ipc=host)."
)
E = "(EngineCore pid=24) ERROR 12-02 04:27:28 [core.py:1510] "
SMALL_SHM = (
    E + "EngineCore failed to start.",
    E + "Traceback (most recent call last):",
    E + '  File "/opt/vllm/site-packages/vllm/distributed/device_communicators/'
    'shm_broadcast.py", line 253, in check_shm_free_space',
    E + "    raise RuntimeError(",
    E + SHM,
    "Process EngineCore:",
    "Traceback (most recent call last):",
    "    raise RuntimeError(",
    SHM,
    "Traceback (most recent call last):",
    '  File "<frozen runpy>", line 198, in _run_module_as_main',
    "    raise RuntimeError(",
    "RuntimeError: Engine core initialization failed. See root cause above. "
    "Failed core proc(s): {'EngineCore': 1}",
)
HF = (
    "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or "
    "'namespace/repo_name': '/models/nonexistent'. Use `repo_type` argument if needed."
)
NO_MODEL = (  # a chained exception: the first one printed is the cause
    "(APIServer pid=1) INFO 12-02 04:26:26 [api_utils.py:286] non-default args: "
    "{'model': '/models/nonexistent'}",
    "Traceback (most recent call last):",
    '  File "/opt/vllm/site-packages/huggingface_hub/utils/_validators.py", line 133, in '
    "validate_repo_id",
    "    raise HFValidationError(",
    HF,
    "The above exception was the direct cause of the following exception:",
    "Traceback (most recent call last):",
    '  File "/opt/vllm/site-packages/transformers/utils/hub.py", line 595, in cached_files',
    '    raise OSError(f"{e}") from e',
    "OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
    "'/models/nonexistent'. Use `repo_type` argument if needed.",
)
WARNINGS = (  # printed at every start: warnings, not errors
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "/opt/vllm/site-packages/vllm/entrypoints/openai/api_server.py:24: DeprecationWarning: "
    "`vllm.entrypoints.openai.api_server` is deprecated",
    "  warnings.warn(",
)
BAD_ARGUMENT = (
    *WARNINGS,
    "usage: api_server.py [-h] [--headless]",
    "                     [model_tag]",
    "api_server.py: error: unrecognized arguments: --no-such-flag",
)
LLAMA_NO_MODEL = (
    "0.00.080.658 I srv    load_model: loading model '/models/none.gguf'",
    "0.00.081.177 E gguf_init_from_file: failed to open GGUF file '/models/none.gguf' "
    "(No such file or directory)",
    "0.00.083.916 I srv    operator(): operator(): cleaning up before exit...",
    "0.00.084.715 E srv  llama_server: exiting due to model loading error",
)
SERVING = tuple(
    f"(APIServer pid=1) INFO 12-02 05:{m:02d}:00 [loggers.py:257] Engine 000: Avg "
    "prompt throughput: 0.0 tokens/s"
    for m in range(25)
)
STANDIN = ("vllm-standin: loading", "ERROR Engine core initialization failed.")


@pytest.mark.parametrize(
    ("lines", "cause"),
    [
        pytest.param(TIER_OWNER, TIER, id="tier owner: the worker's error, not the API server's"),
        pytest.param(SMALL_SHM, SHM, id="small /dev/shm: the engine core's error"),
        pytest.param(NO_MODEL, HF, id="no model: the first of a chain"),
        pytest.param(WARNINGS + SMALL_SHM, SHM, id="warnings are not errors"),
        # a traceback logged while it served, long before the failure, is not its cause
        pytest.param(NO_MODEL + SERVING + SMALL_SHM, SHM, id="an older failure"),
        pytest.param(STANDIN, "ERROR Engine core initialization failed.", id="a line marked ERROR"),
        # an error it served on after, followed by 50 more lines, is not why it was killed
        pytest.param(SMALL_SHM + SERVING * 3, None, id="an error long before the end"),
        pytest.param(NO_MODEL + SERVING * 3 + STANDIN, STANDIN[-1], id="then an ERROR line"),
        pytest.param(BAD_ARGUMENT, None, id="argparse: its last line says it"),
        pytest.param(LLAMA_NO_MODEL, None, id="llama-server: no traceback, no ERROR mark"),
        pytest.param((), None, id="no output"),
    ],
)
def test_the_root_cause_is_the_first_error_of_the_last_failure(
    lines: tuple[str, ...], cause: str | None
) -> None:
    assert root_cause(lines) == cause


def _exited(code: int, oom: bool = False) -> Container:
    return Container(
        id="c1",
        name="lucia-x",
        image_id="sha256:1",
        status="exited",
        exit_code=code,
        oom_killed=oom,
        started_at="t",
        labels={},
        bindings=(),
    )


@pytest.mark.parametrize(
    ("code", "oom", "lines", "starts", "ends"),
    [
        # the cause leads, then the exit code and the last lines
        (1, False, TIER_OWNER, f"{TIER} (exited with code 1; last output: ", f"{LAST})"),
        (1, False, NO_MODEL, f"{HF} (exited with code 1; last output: ", "argument if needed.)"),
        # no cause named: the exit code and the last lines, as they always were
        (
            2,
            False,
            BAD_ARGUMENT,
            "exited with code 2: ",
            "| api_server.py: error: unrecognized arguments: --no-such-flag",
        ),
        (1, False, LLAMA_NO_MODEL, "exited with code 1: ", "exiting due to model loading error"),
        (3, False, (), "exited with code 3", "exited with code 3"),
        # killed for memory says so, whatever was logged
        (
            137,
            True,
            SMALL_SHM,
            "exited with code 137: killed for using too much memory: ",
            "{'EngineCore': 1}",
        ),
    ],
)
def test_the_exit_message_leads_with_the_cause_and_keeps_the_exit_code(
    code: int, oom: bool, lines: tuple[str, ...], starts: str, ends: str
) -> None:
    message = exit_message(_exited(code, oom), lines)
    assert message.startswith(starts), message
    assert message.endswith(ends), message
    assert len(message) <= MAX_MESSAGE
    assert clean_message(message) == message  # status.json's cleaning leaves it whole


@pytest.mark.parametrize(
    "lines",
    [
        (*TIER_OWNER[:-1], "RuntimeError: " + "x" * 2000),  # a huge last line
        ("Traceback (most recent call last):", "ValueError: " + "y" * 2000, "z" * 2000),
        tuple(f"line {n} " + "w" * 200 for n in range(50)),
    ],
)
def test_the_exit_message_fits_status_json(lines: tuple[str, ...]) -> None:
    message = exit_message(_exited(1), lines)
    assert len(message) <= MAX_MESSAGE
    assert message.startswith(("ValueError: yyy", "exited with code 1: ", TIER)), message
    assert "exited with code 1" in message


class _Logs:
    """A runtime's logs: the last `tail` lines of one container's output."""

    def __init__(self, lines: tuple[str, ...]) -> None:
        self.lines = lines

    def logs(self, container_id: str, tail: int = 5) -> list[str]:
        return list(self.lines[-tail:])


def test_a_start_that_died_is_failed_with_the_cause_far_above_its_last_lines() -> None:
    early = tuple(
        f"(APIServer pid=1) INFO 12-02 04:28:{n % 60:02d} [core.py:133] loading" for n in range(300)
    )
    died = actions.died(_Logs(early + TIER_OWNER), _exited(1))  # type: ignore[arg-type]
    assert str(died).startswith(f"{TIER} (exited with code 1; last output: ")
