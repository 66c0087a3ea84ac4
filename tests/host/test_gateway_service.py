"""The gateway as a service: TLS from configured files, READY and the watchdog over sd_notify,
its file_sd target, the warning for keys in clear, and exit 78 for bad settings or keys."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from supervisor.host.gateway.service import Service
from supervisor.host.gateway.settings import SettingsError
from tests.host.gateway_world import AUTH, INFERENCE_KEY, KEYS, OWNER_KEY, settings_of, write_status

ROOT = Path(__file__).resolve().parents[2]


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lucia-gateway-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "gw.crt", directory / "gw.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A stand-in for the service manager's notify socket: what the gateway says arrives."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # the pings come each half second
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield sock
    sock.close()


async def received(sock: socket.socket, wanted: bytes) -> list[bytes]:
    got: list[bytes] = []
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(30):
        while wanted not in got:
            got.append(await loop.sock_recv(sock, 4096))
    return got


def test_tls_ready_watchdog_and_the_target(tmp_path: Path, notify_socket: socket.socket) -> None:
    cert, key = self_signed(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    settings = settings_of(f'[listen]\nport = 0\ntls_cert = "{cert}"\ntls_key = "{key}"\n')

    async def main() -> None:
        write_status(data, "small", "stopped")
        service = Service(settings, data, KEYS)
        running = asyncio.create_task(service.run())
        said = await received(notify_socket, b"READY=1")
        assert service.port is not None
        base = f"https://127.0.0.1:{service.port}"
        trusted = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.get(f"{base}/v1/models", ssl=trusted) as r:
                assert r.status == 200
                assert [m["id"] for m in (await r.json())["data"]] == ["tiny"]
            with pytest.raises(aiohttp.ClientError):  # plain HTTP gets no answer
                async with s.get(f"http://127.0.0.1:{service.port}/v1/models") as r:
                    await r.read()
        said += await received(notify_socket, b"WATCHDOG=1")
        service.stop.set()
        await running
        said += await received(notify_socket, b"STOPPING=1")
        assert said.index(b"READY=1") < said.index(b"WATCHDOG=1") < said.index(b"STOPPING=1")
        target = json.loads((data / "telemetry" / "_gateway.json").read_text())
        assert target[0]["targets"] == [f"127.0.0.1:{service.port}"]
        assert target[0]["labels"]["__scheme__"] == "https"

    asyncio.run(main())


def test_a_slowloris_is_closed_while_others_are_served(tmp_path: Path) -> None:
    """A client that trickles its headers a byte at a time and never ends them is closed at the
    header timeout however often it sends; another client is answered meanwhile. aiohttp's own
    bound is an hour: the 30 s bound below would run out first."""
    data = tmp_path / "data"
    data.mkdir()
    settings = settings_of("[listen]\nport = 0\nheader_timeout_s = 0.5\n")

    async def main() -> None:
        write_status(data, "small", "stopped")
        service = Service(settings, data, KEYS)
        running = asyncio.create_task(service.run())
        await asyncio.wait_for(service.listening.wait(), 30)
        reader, writer = await asyncio.open_connection("127.0.0.1", service.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Pad: ")
        closed = False
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.get(f"http://127.0.0.1:{service.port}/v1/models") as r:
                assert r.status == 200  # served while the slow one hangs on
            async with asyncio.timeout(30):
                sent = 0
                while not closed:
                    try:
                        writer.write(b"a")  # a byte at a time: within every size limit
                        await writer.drain()
                        sent += 1
                        closed = await asyncio.wait_for(reader.read(), 0.05) == b""
                    except TimeoutError:
                        continue
                    except ConnectionError:
                        closed = True
        writer.close()
        service.stop.set()
        await running
        assert closed and sent > 1

    asyncio.run(main())


def test_unusable_tls_files_name_the_setting(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    key.write_text("not a key\n")
    settings = settings_of(f'[listen]\ntls_cert = "{cert}"\ntls_key = "{key}"\n')
    with pytest.raises(SettingsError, match=r"listen\.tls_cert"):
        Service(settings, tmp_path, KEYS)


def test_a_lan_address_without_tls_is_warned_of_at_start(tmp_path: Path) -> None:
    settings = settings_of('[listen]\naddress = "0.0.0.0"\nport = 0\n')

    async def main() -> list[dict[str, object]]:
        service = Service(settings, tmp_path, KEYS)
        with structlog.testing.capture_logs() as logs:
            running = asyncio.create_task(service.run())
            await asyncio.wait_for(service.listening.wait(), 30)
            service.stop.set()
            await running
        return logs

    logs = asyncio.run(main())
    warnings = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1 and "listen.tls_cert" in str(warnings[0])


def _keys(tmp_path: Path, owner: str, inference: str) -> str:
    (tmp_path / "owner.key").write_text(owner + "\n")
    (tmp_path / "inference.key").write_text(inference + "\n")
    return (
        f'[keys]\nowner_file = "{tmp_path / "owner.key"}"\n'
        f'inference_file = "{tmp_path / "inference.key"}"\n'
    )


@pytest.mark.parametrize(
    ("settings", "owner", "inference", "words"),
    [
        ("[limits]\nrunning = 0\n", OWNER_KEY, INFERENCE_KEY, "limits.running"),
        ("[listen]\nport = 99999\n", OWNER_KEY, INFERENCE_KEY, "listen.port"),
        ("[listen]\nheader_timeout_s = 0\n", OWNER_KEY, INFERENCE_KEY, "listen.header_timeout_s"),
        ("", "short", INFERENCE_KEY, "a key has at least 32 and at most 1024 characters"),
        ("", OWNER_KEY, OWNER_KEY, "must differ"),
        (
            '[tiers]\n"fast model" = "tiny"\n',
            OWNER_KEY,
            INFERENCE_KEY,
            "tiers: alias 'fast model' is not a served name: it has a space",
        ),
    ],
)
def test_bad_settings_or_keys_exit_78_with_the_rule(
    tmp_path: Path, settings: str, owner: str, inference: str, words: str
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(settings + _keys(tmp_path, owner, inference))
    done = gateway("--settings", str(path), "--data-dir", str(tmp_path))
    assert done.returncode == 78
    assert words in done.stderr
    assert OWNER_KEY not in done.stderr and INFERENCE_KEY not in done.stderr
    assert "short" not in done.stderr.replace("shorter", "")


PEER_A, PEER_B = "p" * 40, "q" * 40


@pytest.mark.parametrize(
    ("lines", "mode", "words"),
    [
        (None, 0o600, "no such file"),
        (f"a {PEER_A}\nb {PEER_B}\n", 0o644, "has mode 0644; a peers file is owner-only"),
        (f"b {PEER_B}\n", 0o600, "this machine, a ([fleet] machine), has no line"),
        (f"a {PEER_A}\nb {OWNER_KEY}\n", 0o600, "line 2: machine b's key is the owner key"),
        (f"a {PEER_A}\nb {PEER_A}\n", 0o600, "line 2: machine b's key is machine a's too"),
    ],
)
def test_a_bad_peers_file_exits_78_naming_it_never_a_key(
    tmp_path: Path, lines: str | None, mode: int, words: str
) -> None:
    peers = tmp_path / "peers.keys"
    if lines is not None:
        peers.write_text(lines)
        peers.chmod(mode)
    path = tmp_path / "gateway.toml"
    path.write_text(
        '[record]\ndsn = "postgresql://lucia@127.0.0.1:1/none"\n'
        f'[fleet]\nmachine = "a"\nadvertise = "http://127.0.0.1:1"\npeers_file = "{peers}"\n'
        + _keys(tmp_path, OWNER_KEY, INFERENCE_KEY)
    )
    done = gateway("--settings", str(path), "--data-dir", str(tmp_path))
    assert done.returncode == 78
    assert str(peers) in done.stderr and words in done.stderr
    for key in (PEER_A, PEER_B, OWNER_KEY):
        assert key not in done.stderr


def test_a_settings_file_named_must_exist(tmp_path: Path) -> None:
    done = gateway("--settings", str(tmp_path / "nowhere.toml"))
    assert done.returncode == 78
    assert "no such settings file" in done.stderr


def gateway(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "gateway", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
