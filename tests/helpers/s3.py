"""A real S3 server for the tests (moto's ``ThreadedMotoServer``: real HTTP on 127.0.0.1, a free port, no Docker, no
mock of any client), and ``FaultProxy``, our own small HTTP proxy in front of it that answers chosen requests with a
503 SlowDown, a 403 AccessDenied, a connection reset half-way through the body, or a delay past the client's read timeout.

Every process a test starts sees the server through the standard variables alone (``s3_env``): ``AWS_ENDPOINT_URL``
and a key pair, as a MinIO user would set them.

    server = S3Server()              # started; server.stop() at the end
    server.upload(pack_folder, "bucket", "pack")
    os.environ.update(server.env())  # s3://bucket/pack now reads from it, in every process

A test module takes the fixtures ``server`` (one server for the module) and ``env`` (the standard variables pointing
at it, and a shard cache of the test's own) by importing ``s3_server_fixture`` and ``s3_env_fixture``.
"""

from __future__ import annotations

import http.client
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

#: The secret key the tests use: a test checks it never appears in any output or file.
SECRET = "cltrainTestSecretKey0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_env(endpoint: str, secret: str = SECRET) -> dict[str, str]:
    """The standard variables that point every S3 client of every process at ``endpoint`` (and nowhere else)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "cltraintestkey", "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


class S3Server:
    """moto's S3 server on a free port of 127.0.0.1 (started here)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """``s3_env`` of this server."""
        return s3_env(self.endpoint)

    def client(self):  # noqa: ANN201 - a boto3 client
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="cltraintestkey",
                            aws_secret_access_key=SECRET, region_name="us-east-1")

    def upload(self, folder: Path, bucket: str, prefix: str) -> str:
        """Copy ``folder`` as it is to ``s3://bucket/prefix`` (``shards.json`` last, as a user's sync would not
        guarantee but a pack needs); its URL."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
        for p in sorted(files, key=lambda p: p.name == "shards.json"):
            client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder).as_posix()}")
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        self.server.stop()


@dataclass
class Fault:
    """Answer the next ``times`` requests whose method is ``method`` and whose path holds ``path`` with ``kind``:
    ``"slowdown"`` (503 SlowDown), ``"denied"`` (403 AccessDenied), ``"reset"`` (the headers and half the body,
    then a TCP reset) or ``"stall"`` (nothing for ``seconds``, then the answer)."""

    kind: str
    path: str = ""
    method: str = "GET"
    times: int = 1
    seconds: float = 3.0
    hit: int = field(default=0)


class FaultProxy:
    """An HTTP proxy on a free port in front of ``target`` (``http://127.0.0.1:<port>``) that injects ``faults``
    (see ``Fault``) and counts the requests it passes on (``seen``: ``(method, path)``)."""

    def __init__(self, target: str) -> None:
        host, port = target.split("//", 1)[1].split(":")
        self.faults: list[Fault] = []
        self.seen: list[tuple[str, str]] = []
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with proxy.lock:
                    proxy.connections.append(self.connection)

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy._take(self.command, self.path)
                errors = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
                          "denied": (403, "AccessDenied", "Access Denied")}
                if fault is not None and fault.kind in errors:
                    status, code, message = errors[fault.kind]
                    text = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                            f"<Message>{message}</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(text)))
                    self.end_headers()
                    self.wfile.write(text)
                    return
                if fault is not None and fault.kind == "stall":
                    time.sleep(fault.seconds)
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                conn.close()
                with proxy.lock:
                    proxy.seen.append((self.command, self.path))
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "date", "server"):
                        self.send_header(k, v)
                self.end_headers()
                if fault is not None and fault.kind == "reset" and self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.hit < fault.times and fault.method == method and fault.path in path:
                    fault.hit += 1
                    return fault
        return None

    def gets(self, part: str) -> int:
        """How many GETs of a path holding ``part`` reached the server."""
        with self.lock:
            return sum(1 for m, p in self.seen if m == "GET" and part in p)

    def stop(self) -> None:
        """Stop listening and drop the open connections (as a server that went away)."""
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            for conn in self.connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(scope="module", name="server")
def s3_server_fixture() -> S3Server:
    """One S3 server for the test module."""
    s3 = S3Server()
    yield s3
    s3.stop()


@pytest.fixture(name="env")
def s3_env_fixture(server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The standard S3 variables pointing at ``server`` (every process the test starts sees them), and a shard cache
    of the test's own (``CLTRAIN_SHARD_CACHE``), whose folder is returned."""
    for k, v in s3_env(server.endpoint).items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CLTRAIN_SHARD_CACHE", str(cache))
    return cache
