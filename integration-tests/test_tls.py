"""HTTPS: `cadence launch --ssl-certfile --ssl-keyfile` with a certificate authority and a
server certificate this test makes, driven by the OpenAI SDK and httpx over TLS; a client
that does not trust the authority, or speaks plain HTTP, gets no answer; a certificate and
key that do not match stop the launch before any model loads."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conftest import LaunchedServer, launch, reference_up_to_eos, stop, tiny_model

NEW_TOKENS = 64  # conftest's reference length


@dataclass
class Certificates:
    authority: Path  # the CA's certificate: what clients trust
    certfile: Path  # the server's certificate, signed by the CA
    keyfile: Path  # its private key
    other_keyfile: Path  # a key that belongs to no certificate here


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def make_certificates(folder: Path) -> Certificates:
    """A self-signed certificate authority and a server certificate for localhost and
    127.0.0.1 that it signs."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("cadence test CA"))
        .issuer_name(_name("cadence test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    authority = folder / "ca.pem"
    authority.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    certfile = folder / "server.pem"
    certfile.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    return Certificates(
        authority=authority,
        certfile=certfile,
        keyfile=_write_key(server_key, folder / "server.key"),
        other_keyfile=_write_key(ec.generate_private_key(ec.SECP256R1()), folder / "other.key"),
    )


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def trust(certificates: Certificates) -> ssl.SSLContext:
    """A client context that trusts the test's authority (and nothing else)."""
    return ssl.create_default_context(cafile=str(certificates.authority))


@pytest.fixture(scope="module")
def https_server(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_llama_dir: str,
    certificates: Certificates,
    trust: ssl.SSLContext,
) -> Iterator[LaunchedServer]:
    server = launch(
        tmp_path_factory.mktemp("https"),
        *tiny_model(tiny_llama_dir, 256),
        "--served-model-name",
        "tiny",
        "--ssl-certfile",
        str(certificates.certfile),
        "--ssl-keyfile",
        str(certificates.keyfile),
        trust=trust,
    )
    yield server
    assert stop(server) == 0, server.log()


def test_generate_over_https_gives_the_reference_tokens(
    https_server: LaunchedServer,
    trust: ssl.SSLContext,
    tiny_reference: tuple[list[str], list[list[int]], int],
) -> None:
    texts, expected, eos_id = tiny_reference
    with httpx.Client(base_url=https_server.url, verify=trust, timeout=120) as client:
        response = client.post(
            "/generate",
            json={
                "inputs": texts[0],
                "parameters": {"max_new_tokens": NEW_TOKENS, "details": True},
            },
        )
    assert response.status_code == 200, response.text
    ids = [token["id"] for token in response.json()["details"]["tokens"]]
    assert ids == reference_up_to_eos(expected[0], eos_id)


def test_the_openai_sdk_streams_over_https(
    https_server: LaunchedServer, trust: ssl.SSLContext
) -> None:
    with httpx.Client(verify=trust) as http:
        client = openai.OpenAI(base_url=f"{https_server.url}/v1", api_key="-", http_client=http)
        request = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
            "max_tokens": 24,
            "temperature": 0,
        }
        whole = client.chat.completions.create(**request)
        pieces = [
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(**request, stream=True)
            if chunk.choices
        ]
    assert whole.usage.completion_tokens == 24
    assert "".join(pieces) == whole.choices[0].message.content


def test_a_client_that_does_not_trust_the_authority_is_refused(
    https_server: LaunchedServer,
) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{https_server.url}/health", timeout=10)


def test_plain_http_gets_no_answer_on_the_https_port(https_server: LaunchedServer) -> None:
    plain = https_server.url.replace("https://localhost", "http://127.0.0.1")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/health", timeout=10)
    # ... and the server goes on serving HTTPS clients.
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    assert httpx.get(f"{https_server.url}/health", verify=context, timeout=10).status_code == 200


def test_a_key_that_is_not_the_certificates_stops_the_launch_before_loading(
    tmp_path: Path, tiny_llama_dir: str, certificates: Certificates
) -> None:
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadence",
            "launch",
            *tiny_model(tiny_llama_dir, 64),
            "--ssl-certfile",
            str(certificates.certfile),
            "--ssl-keyfile",
            str(certificates.other_keyfile),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = launched.stdout + launched.stderr
    assert launched.returncode != 0, output
    assert "--ssl-keyfile" in output and str(certificates.other_keyfile) in output, output
    assert "shard" not in output.lower(), output  # nothing was started
