"""A ``~/.netrc`` never takes the place of a cloud's credentials. requests (Azure's blocking
client, GCS's) and aiohttp (adlfs's asyncio Azure client) put a netrc entry for the host, or the
file's ``default`` entry, over the ``Authorization`` header the cloud's client set: every request
went out with the netrc's login and password, and the store refused it (Azure 403; aiohttp
refused the pair itself; GCS 401, which the emulator answers as GCS does). With a netrc whose
``default`` entry names a login and password, ``python -m jobs.build`` turns a lake on each store
into a dataset there, the loader reads every row of it, and the password reaches neither store."""

from __future__ import annotations

import base64
import http.server
import json
import socket
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest

from lakeshard import storage
from lakeshard.format import channel_shards
from loaders import ShardLoader
from tests.hardening.helpers import REPO, job_env
from tests.helpers.checks import check_dataset
from tests.helpers.lake import write_lake

pytestmark = pytest.mark.slow

_LOGIN, _PASSWORD = "someone", "netrc-password-7f3a"


@pytest.fixture()
def netrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A netrc file with a ``default`` entry (every host), named by ``NETRC`` as requests and
    aiohttp read it (``~/.netrc`` otherwise)."""
    path = tmp_path / "netrc"
    path.write_text(f"default login {_LOGIN} password {_PASSWORD}\n")
    path.chmod(0o600)
    monkeypatch.setenv("NETRC", str(path))
    return path


@pytest.mark.parametrize(
    "scheme", [pytest.param("gs", marks=pytest.mark.gcs), pytest.param("az", marks=pytest.mark.azure)]
)
@pytest.mark.timeout(600)
def test_a_netrc_default_entry_is_never_sent_to_a_cloud_store(
    scheme: str, netrc: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    root = request.getfixturevalue("gcs_bucket" if scheme == "gs" else "az_container")
    local = tmp_path / "lake"
    write_lake(local, {"cat": 10, "dog": 10})
    for p in sorted(local.rglob("*")):
        if p.is_file():
            storage.write_bytes_atomic(f"{root}/raw/{p.relative_to(local).as_posix()}", p.read_bytes())
    out = f"{root}/ds"
    args = ["--engine", "local", "--input", f"{root}/raw", "--output", out, "--split-method", "stratified"]
    done = subprocess.run(
        [sys.executable, "-m", "jobs.build", *args, "--num-shards", "1", "--image-size", "16"],
        cwd=REPO,
        env=job_env(),  # NETRC and the store's endpoint, from this process's environment
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    info = check_dataset(out)
    train = sum(rows for _, rows in channel_shards(out, info, "train"))
    with ShardLoader(out, batch_size=2) as loader:
        assert sum(len(labels) for _, labels in loader) == train > 0
    if scheme == "az":
        basic = base64.b64encode(f"{_LOGIN}:{_PASSWORD}".encode()).decode()
        log = request.getfixturevalue("azurite").served_log()
        assert f"/{root.split('://', 1)[1]}/ds/" in log  # the log holds the dataset's requests
        assert '"authorization":"SharedKey ' in log  # with their headers
        assert basic not in log and _PASSWORD not in log


class _ForwardProxy:
    """A forward HTTP proxy on 127.0.0.1: each connection relayed to the host its first request
    names in absolute form (``GET http://host:port/path``), whose first lines it keeps."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client:
            head = client.recv(65536)
            line = head.split(b"\r\n", 1)[0].decode(errors="replace")
            self.requests.append(line)
            target = urllib.parse.urlsplit(line.split(" ")[1])
            with socket.create_connection((target.hostname, target.port or 80)) as upstream:
                upstream.sendall(head)
                back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
                back.start()
                _pipe(client, upstream)
                back.join()

    def close(self) -> None:
        self._server.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


@pytest.mark.azure
@pytest.mark.timeout(300)
def test_azure_clients_still_go_through_the_environments_proxy(az_container: str) -> None:
    """Neither Azure client reads a netrc any more; both still send every request through the
    proxy ``HTTP_PROXY`` names: the blocking client's requests session reads it, the asyncio
    one (adlfs: listings, Parquet) is given it for its endpoint. A fresh process, as a user's."""
    proxy = _ForwardProxy()
    container = az_container.split("://", 1)[1]
    script = (
        "import sys; from lakeshard import storage; root = sys.argv[1]\n"
        "storage.write_bytes_atomic(root + '/p/one', b'1')\n"  # the blocking client
        "fs, path = storage.filesystem(root)\n"
        "print(sorted(fs.find(path + '/p')))\n"  # adlfs's asyncio client
    )
    env = job_env(HTTP_PROXY=proxy.url, http_proxy=proxy.url)
    for name in ("NO_PROXY", "no_proxy"):
        env.pop(name, None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, az_container],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        proxy.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"'{container}/p/one'" in done.stdout
    assert any(r.startswith("PUT http://") and f"/{container}/p/one" in r for r in proxy.requests)
    assert any(r.startswith("GET http://") and "comp=list" in r for r in proxy.requests), proxy.requests


@pytest.mark.gcs
@pytest.mark.timeout(300)
def test_gcs_token_requests_take_nothing_from_netrc(gcs_bucket: str, netrc: Path, tmp_path: Path) -> None:
    """With a service account's key file, Google's client asks the key's ``token_uri`` for a
    token through a requests session of its own: that session reads no netrc either. The token
    endpoint here is a local server that hands out a token and keeps each request's
    ``Authorization``; the read then goes to the emulator with that token."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    asked: list[str | None] = []

    class Tokens(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            asked.append(self.headers.get("Authorization"))
            body = json.dumps({"access_token": "token-1", "expires_in": 3600, "token_type": "Bearer"})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tokens)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key = tmp_path / "key.json"
    key.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": "lakeshard-test",
                "private_key_id": "k1",
                "private_key": pem.decode(),
                "client_email": "reader@lakeshard-test.iam.gserviceaccount.com",
                "client_id": "1",
                "token_uri": f"http://127.0.0.1:{server.server_port}/token",
            }
        )
    )
    storage.write_bytes_atomic(f"{gcs_bucket}/one", b"bytes of one")
    script = "import sys; from lakeshard import storage; print(storage.read_bytes(sys.argv[1]))"
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, f"{gcs_bucket}/one"],
            cwd=REPO,
            env=job_env(GOOGLE_APPLICATION_CREDENTIALS=str(key)),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "b'bytes of one'"
    assert asked and all(a is None for a in asked)  # token requests, none with the netrc's credentials
