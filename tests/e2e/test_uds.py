"""vLLM's --uds: `m3serve serve` on a Unix domain socket instead of TCP: the start-up line names
it, the API answers over it (health, models, a completion, the openai client through an httpx
UDS transport), a stale socket file is replaced, a live one or a non-socket path is refused with
the flag named, and the file is removed when the server stops."""

import http.client
import json
import os
import signal
import socket
import subprocess

import httpx
import openai

from conftest import MODEL_NAME


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.path)


def request(path, method, url, body=None):
    c = UnixConnection(path)
    c.request(method, url, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"} if body is not None else {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def start(binary, model_dir, sock):
    p = subprocess.Popen([binary, "serve", model_dir, "--uds", sock, "--served-model-name", MODEL_NAME,
                          "--max-model-len", "512", "--kv-cache-memory-bytes", "16MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    return p, p.stdout.readline()


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def test_serves_over_a_unix_socket(binary, model_dir, tmp_path):
    sock = str(tmp_path / "m3.sock")
    # A stale socket file (its server gone) is replaced.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(sock)
    stale.close()
    p, line = start(binary, model_dir, sock)
    try:
        assert f"listening on unix:{sock}" in line, line + p.stderr.read() if p.poll() is not None else line
        status, _ = request(sock, "GET", "/health")
        assert status == 200
        status, data = request(sock, "GET", "/v1/models")
        assert status == 200 and json.loads(data)["data"][0]["id"] == MODEL_NAME
        status, data = request(sock, "POST", "/v1/completions",
                               {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert status == 200, data
        assert json.loads(data)["usage"]["completion_tokens"] == 4
        # The official client, through httpx's Unix-socket transport.
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x",
                               http_client=httpx.Client(transport=httpx.HTTPTransport(uds=sock)))
        out = client.chat.completions.create(model=MODEL_NAME, max_tokens=3, temperature=0,
                                             messages=[{"role": "user", "content": "hi"}])
        assert out.usage.completion_tokens == 3
        # A second server on the same live socket is refused, naming the flag.
        q, qline = start(binary, model_dir, sock)
        assert q.wait(timeout=120) != 0
        err = q.stderr.read()
        assert "another process listens on this socket" in err and "--uds" in err, err
    finally:
        stop(p)
    assert not os.path.exists(sock), "the socket file is removed at shutdown"


def test_a_path_that_is_not_a_socket_is_refused(binary, model_dir, tmp_path):
    f = tmp_path / "plain.txt"
    f.write_text("keep me")
    p, _ = start(binary, model_dir, str(f))
    assert p.wait(timeout=120) != 0
    err = p.stderr.read()
    assert "exists and is not a socket" in err, err
    assert f.read_text() == "keep me"
