"""Mutual TLS between the gateways of a fleet: with `[listen] tls_cert` set, a peer request must
come with a client certificate the fleet's CA signed, and the forwarding client presents its
gateway's own and verifies the peer's; a caller's client on /v1 needs none. The serving gateway
in process, over real TLS sockets on loopback; certificates made here."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from supervisor.host.fleet.forward import Peer
from supervisor.host.fleet.peers import Peers, taken_by
from supervisor.host.fleet.tls import client_context
from supervisor.host.gateway.app import Intervals, create_app
from supervisor.host.gateway.service import tls_context
from supervisor.host.gateway.settings import GatewaySettings, SettingsError
from supervisor.host.keycheck import Identity
from tests.host.fleet_world import CHAT, origin, write_peers
from tests.host.gateway_world import (
    INFERENCE_KEY,
    KEYS,
    Upstream,
    serve_upstream,
    settings_of,
    write_status,
)

CHATS = "/v1/chat/completions"
NOW = datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    file: Path


def authority(directory: Path, name: str) -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - datetime.timedelta(minutes=1))
        .not_valid_after(NOW + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    file = directory / f"{name}.crt"
    file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Authority(key, cert, file)


def gateway_cert(directory: Path, ca: Authority, name: str) -> tuple[Path, Path]:
    """A gateway's certificate for 127.0.0.1, for both ends (serverAuth and clientAuth)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - datetime.timedelta(minutes=1))
        .not_valid_after(NOW + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
        .sign(ca.key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return cert_file, key_file


@dataclass(frozen=True)
class World:
    url: str  # b's gateway, https
    peers_file: Path
    ca: Authority
    a_cert: tuple[Path, Path]
    rogue: Authority
    rogue_cert: tuple[Path, Path]
    upstream: Upstream


def settings(tmp: Path, ca: Authority, cert: tuple[Path, Path], peers: Path) -> GatewaySettings:
    return settings_of(
        f'[listen]\ntls_cert = "{cert[0]}"\ntls_key = "{cert[1]}"\n'
        '[record]\ndsn = "postgresql://lucia@127.0.0.1/unused"\n'
        f'[fleet]\nmachine = "b"\nadvertise = "https://127.0.0.1:1"\npeers_file = "{peers}"\n'
        f'ca_file = "{ca.file}"\n'
    )


@asynccontextmanager
async def tls_fleet(tmp: Path) -> AsyncIterator[World]:
    """Machine b's gateway over TLS, asking for client certificates of the fleet's CA."""
    ca, rogue = authority(tmp, "fleet-ca"), authority(tmp, "rogue-ca")
    peers = tmp / "peers.keys"
    write_peers(peers, {"a": "a" * 40, "b": "b" * 40})
    made = settings(tmp, ca, gateway_cert(tmp, ca, "b"), peers)
    upstream = Upstream()
    engine = await serve_upstream(upstream)
    data = tmp / "data"
    write_status(data, "small", "running", url=upstream.url)
    app = create_app(
        made,
        data,
        KEYS,
        Intervals(keepalive_s=0.05, poll_s=0.02, idle_check_s=0.02, bounds_s=0.02),
        peers=Peers.open(peers, "b", taken_by(KEYS)),
    )
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls_context(made.listen, ca.file))
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield World(
            f"https://127.0.0.1:{port}",
            peers,
            ca,
            gateway_cert(tmp, ca, "a"),
            rogue,
            gateway_cert(tmp, rogue, "a-rogue"),
            upstream,
        )
    finally:
        await runner.cleanup()
        await engine.close()


CALLER = Identity("key_0123456789ab", "inference", "someone")


async def through(w: World, tls: ssl.SSLContext) -> tuple[int, Any]:
    async with (
        origin(w.peers_file, Peer("b", w.url), CALLER, tls=tls) as url,
        aiohttp.ClientSession() as session,
        session.post(url + CHATS, json=CHAT) as answer,
    ):
        return answer.status, await answer.json()


def test_a_peer_with_the_fleets_certificate_is_served(tmp_path: Path) -> None:
    async def main() -> None:
        async with tls_fleet(tmp_path) as w:
            status, answer = await through(w, client_context(*w.a_cert, w.ca.file))
            assert status == 200, answer
            assert len(w.upstream.bodies) == 1

    asyncio.run(main())


def test_a_peer_request_without_a_client_certificate_is_401(tmp_path: Path) -> None:
    async def main() -> None:
        async with tls_fleet(tmp_path) as w:
            bare = ssl.create_default_context(cafile=w.ca.file)  # b's verified, none shown
            with structlog.testing.capture_logs() as logs:
                status, answer = await through(w, bare)
            assert status == 401 and answer["error"]["code"] == "peer_unauthorized"
            refused = [e for e in logs if e["event"] == "peer refused"]
            assert refused[0]["reason"].startswith("no client certificate")
            assert refused[0]["machine"] == "a"
            assert w.upstream.bodies == []

    asyncio.run(main())


@pytest.mark.parametrize("which", ["rogue client", "rogue server"])
def test_a_certificate_of_another_ca_is_refused_in_the_handshake(
    tmp_path: Path, which: str
) -> None:
    async def main() -> None:
        async with tls_fleet(tmp_path) as w:
            if which == "rogue client":  # b refuses a's certificate
                tls = client_context(*w.rogue_cert, w.ca.file)
            else:  # a does not trust b's
                tls = client_context(*w.a_cert, w.rogue.file)
            status, answer = await through(w, tls)
            assert status == 503 and answer["error"]["code"] == "model_not_loaded"
            assert answer["error"]["machine"] == "b"
            if which == "rogue server":
                assert "CERTIFICATE_VERIFY_FAILED" in answer["error"]["message"]
            assert w.upstream.bodies == []

    asyncio.run(main())


def test_a_caller_on_v1_needs_no_client_certificate(tmp_path: Path) -> None:
    async def main() -> None:
        async with tls_fleet(tmp_path) as w:
            trusting = ssl.create_default_context(cafile=w.ca.file)
            headers = {"Authorization": f"Bearer {INFERENCE_KEY}"}
            async with (
                aiohttp.ClientSession(headers=headers) as session,
                session.post(w.url + CHATS, json=CHAT, ssl=trusting) as answer,
            ):
                assert answer.status == 200

    asyncio.run(main())


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            '[listen]\ntls_cert = "/c"\ntls_key = "/k"\n[record]\ndsn = "postgresql://x/y"\n'
            '[fleet]\nmachine = "b"\nadvertise = "https://b:8400"\n',
            "[fleet] ca_file must name the CA",
        ),
        ('[fleet]\nca_file = "/ca.crt"\n', "fleet.ca_file is for mutual TLS"),
    ],
)
def test_mutual_tls_needs_both_the_certificate_and_the_ca(text: str, says: str) -> None:
    with pytest.raises(SettingsError) as refused:
        settings_of(text)
    assert says in str(refused.value)


def test_an_unusable_ca_file_names_the_setting(tmp_path: Path) -> None:
    ca = authority(tmp_path, "ca")
    cert = gateway_cert(tmp_path, ca, "b")
    bad = tmp_path / "bad.crt"
    bad.write_text("not a certificate\n")
    made = settings_of(f'[listen]\ntls_cert = "{cert[0]}"\ntls_key = "{cert[1]}"\n')
    with pytest.raises(SettingsError, match=r"fleet\.ca_file"):
        tls_context(made.listen, bad)
