"""The remote judge and oracle against a chat-completions server written here (``http.server`` in a thread).

The server answers from a script of replies (status, body, delay), so each test sets exactly what the client meets:
normal replies, 5xx and 429 then success, a server past the timeout, garbage bodies and missing fields.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import math
import pickle
import re
import socketserver
import ssl
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from alignment_games.modules.algorithms.debate import Transcript, split_reply
from alignment_games.modules.lm.sampling import Sampling
from alignment_games.modules.scorers.judges import HFJudge, PromptedJudge, RemoteJudge
from alignment_games.modules.scorers.oracle import LLMJudgeOracle, PromptedOracle, RemoteJudgeOracle
from alignment_games.modules.scorers.remote import REDACTED, ChatServer, RemoteServerError, quoted_reply


def completion(*contents) -> bytes:
    """An OpenAI chat-completions body with one choice per content."""
    choices = [{"index": i, "message": {"role": "assistant", "content": c}} for i, c in enumerate(contents)]
    return json.dumps({"id": "x", "object": "chat.completion", "choices": choices}).encode()


class Script:
    """Replies served in order (the last one repeats), and the requests received.

    A reply is ``(status, body, delay)`` or ``(status, body, delay, headers)`` with extra reply headers.
    """

    def __init__(self) -> None:
        self.replies: list[tuple] = []
        self.requests: list[tuple[dict | None, dict]] = []
        self.times: list[float] = []  # time.monotonic() of each request
        self.lock = threading.Lock()

    def next(self) -> tuple:
        with self.lock:
            return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


class ScriptHandler(BaseHTTPRequestHandler):
    """Answers each request (a POST, or the GET a followed 303 turns it into) with the script's next reply."""

    script: Script

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with self.script.lock:
            self.script.requests.append((json.loads(body) if body else None, dict(self.headers)))
            self.script.times.append(time.monotonic())
        status, reply, delay, *extra = self.script.next()
        time.sleep(delay)
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            for key, value in (extra[0] if extra else {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(reply)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            pass

    do_GET = do_POST

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(handler: type[socketserver.BaseRequestHandler], tls: ssl.SSLContext | None = None):
    """``handler`` answering on a free port of 127.0.0.1 in a thread (over TLS with ``tls``), until the block ends.

    Yields:
        The port.
    """
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    if tls is not None:
        httpd.socket = tls.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def scripted(script: Script):
    """A server answering from ``script`` (a context manager yielding its port)."""
    handler = type("Handler", (ScriptHandler,), {"script": script})
    return serving(handler)


@pytest.fixture
def server():
    script = Script()
    with scripted(script) as port:
        script.url = f"http://127.0.0.1:{port}/v1"
        yield script


def transcript(answer: str = r"2 + 2 = 4. \boxed{4}") -> Transcript:
    replies = [split_reply(x, required=False) for x in (answer, "Looks fine.")]
    return Transcript("What is 2 + 2?", "4", "debate_ab", replies)


def remote_judge(url, tiny_lm_dir, num_votes=3, **server):
    fields = {"base_url": url, "model": "judge", "retries": 2, "backoff_s": 0.01, "timeout_s": 5.0, **server}
    return RemoteJudge(
        server=fields, tokenizer=str(tiny_lm_dir), chain_of_thought=False, num_votes=num_votes, sampling=Sampling()
    )


def test_remote_judge_sends_hfjudges_prompt_and_reads_the_votes(server, tiny_lm_dir):
    server.replies = [(200, completion("Verdict: Alice", "Verdict: Bob", "no idea"), 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir)
    hf = HFJudge(str(tiny_lm_dir), chain_of_thought=False, num_votes=3)
    out = judge.vote([transcript(), transcript("5")])
    assert torch.equal(torch.isnan(out.votes), torch.tensor([[False, False, True]] * 2))
    assert out.votes[:, :2].tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert out.texts[0] == ["Verdict: Alice", "Verdict: Bob", "no idea"]
    payloads = sorted((p for p, _ in server.requests), key=lambda p: p["messages"][0]["content"])
    assert len(payloads) == 2 and all(p["model"] == "judge" and p["n"] == 3 for p in payloads)
    # the user message is HFJudge's request text, built by the same code (the server applies the chat template)
    assert sorted(p["messages"][0]["content"] for p in payloads) == sorted(
        hf.user_message(t) for t in (transcript(), transcript("5"))
    )
    assert payloads[0]["max_tokens"] == Sampling().max_new_tokens and payloads[0]["temperature"] == 1.0


def test_votes_drawn_by_repeated_requests_with_seeds_from_the_judges_generator(server, tiny_lm_dir):
    server.replies = [(200, completion("Verdict: Bob"), 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=4, samples_per_request=1)
    out = judge.vote([transcript()])
    assert out.votes.tolist() == [[0.0] * 4]
    assert [p["n"] for p, _ in server.requests] == [1, 1, 1, 1]
    seeds = [p["seed"] for p, _ in server.requests]
    assert len(set(seeds)) == 4
    again = remote_judge(server.url, tiny_lm_dir, num_votes=4, samples_per_request=1)
    server.requests.clear()
    again.vote([transcript()])
    assert [p["seed"] for p, _ in server.requests] == seeds  # same judge seed, same requests


def test_500s_and_429_are_retried_until_success(server, tiny_lm_dir):
    server.replies = [(500, b"boom", 0.0), (429, b"slow down", 0.0), (200, completion("Verdict: Alice"), 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1)
    assert judge.vote([transcript()]).votes.tolist() == [[1.0]]
    assert len(server.requests) == 3


def test_a_server_that_keeps_failing_raises_naming_the_url(server, tiny_lm_dir):
    server.replies = [(503, b"overloaded", 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, retries=2)
    with pytest.raises(RemoteServerError, match=r"127\.0\.0\.1:\d+/v1/chat/completions failed 3 attempts.*HTTP 503"):
        judge.vote([transcript()])
    assert len(server.requests) == 3


def test_a_refused_request_raises_at_once(server, tiny_lm_dir):
    server.replies = [(404, b'{"error": "model judge not found"}', 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1)
    with pytest.raises(RemoteServerError, match=r"/v1/chat/completions refused the request: HTTP 404.*not found"):
        judge.vote([transcript()])
    assert len(server.requests) == 1


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_naming_the_location_and_the_key_goes_nowhere_else(
    server, tiny_lm_dir, monkeypatch, code
):
    elsewhere = Script()
    elsewhere.replies = [(200, completion("Verdict: Bob"), 0.0)]
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "sekrit-123")
    with scripted(elsewhere) as port:
        location = f"http://127.0.0.1:{port}/v1/chat/completions"
        server.replies = [(code, b"moved", 0.0, {"Location": location})]
        judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, retries=2, api_key_env="JUDGE_KEY_FOR_TEST")
        with pytest.raises(RemoteServerError, match=rf"HTTP {code} redirect to '{re.escape(location)}' refused"):
            judge.vote([transcript()])
    assert len(server.requests) == 1  # refused at once, not retried
    assert server.requests[0][1]["Authorization"] == "Bearer sekrit-123"
    assert elsewhere.requests == []  # the redirected host saw nothing, so it gave no vote


def test_no_server_listening_raises_naming_the_url(tiny_lm_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    judge = remote_judge(f"http://127.0.0.1:{port}/v1", tiny_lm_dir, num_votes=1, retries=1)
    with pytest.raises(RemoteServerError, match=rf"127\.0\.0\.1:{port}/v1/chat/completions failed 2 attempts"):
        judge.vote([transcript()])


def test_a_reply_past_the_timeout_is_retried(server, tiny_lm_dir):
    server.replies = [(200, completion("Verdict: Bob"), 1.0), (200, completion("Verdict: Alice"), 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, timeout_s=0.2)
    assert judge.vote([transcript()]).votes.tolist() == [[1.0]]  # the late Bob was abandoned
    assert len(server.requests) == 2


def test_a_server_slower_than_the_timeout_raises_in_bounded_time(server, tiny_lm_dir):
    server.replies = [(200, completion("Verdict: Bob"), 2.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, timeout_s=0.2, retries=1)
    start = time.perf_counter()
    with pytest.raises(RemoteServerError, match=r"failed 2 attempts; the last: .*timed out"):
        judge.vote([transcript()])
    assert time.perf_counter() - start < 1.5


@pytest.fixture
def tls(tmp_path, monkeypatch) -> ssl.SSLContext:
    """A server context with a self-signed certificate for 127.0.0.1, which the client's default context trusts."""
    pytest.importorskip("cryptography")
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp_path / "key.pem").write_bytes(pem)
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))  # what the default context loads
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    return context


def trickler(where: str, gave_up: threading.Event) -> type[socketserver.BaseRequestHandler]:
    """A server sending a whole ``Verdict: Bob`` reply, but its ``body`` or ``headers`` a byte every 50 ms (5-6.5 s),
    or (``handshake``) a TLS record of 100 bytes as slowly in answer to the client's hello.

    ``gave_up`` is set when the client drops the connection; the trickle ends even when the client waits for it.
    """
    if where == "handshake":

        class SlowHello(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.recv(4096)
                try:
                    self.request.sendall(b"\x16\x03\x03\x00\x64")  # a handshake record of 100 bytes follows
                    for _ in range(100):
                        time.sleep(0.05)
                        self.request.sendall(b"\x00")
                except (BrokenPipeError, ConnectionResetError):
                    gave_up.set()

        return SlowHello
    reply = completion("Verdict: Bob")
    trickled = reply if where == "body" else b"X-Pad: " + b"a" * (100 - 9) + b"\r\n"
    assert 90 <= len(trickled) <= 130

    class Trickle(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            tail = f"Content-Length: {len(reply)}\r\nConnection: close\r\n\r\n".encode()
            try:
                self.wfile.write(head + (tail if where == "body" else b""))
                for i in range(len(trickled)):
                    self.wfile.write(trickled[i : i + 1])
                    time.sleep(0.05)
                self.wfile.write(b"" if where == "body" else tail + reply)
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                gave_up.set()

        def log_message(self, *args):
            pass

    return Trickle


@pytest.mark.parametrize(("where", "https"), [("body", False), ("headers", False), ("body", True), ("handshake", True)])
def test_a_trickling_server_is_abandoned_at_the_wall_clock_deadline(tiny_lm_dir, request, where, https):
    """A byte every 50 ms never trips a per-read timeout; the whole reply takes 5-6.5 s against ``timeout_s=1``."""
    gave_up = threading.Event()
    context = request.getfixturevalue("tls") if https and where != "handshake" else None
    with serving(trickler(where, gave_up), context) as port:
        url = f"{'https' if https else 'http'}://127.0.0.1:{port}/v1"
        judge = remote_judge(url, tiny_lm_dir, num_votes=1, retries=0, timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(RemoteServerError, match=r"failed 1 attempts; the last: .*timeout_s=1\.0"):
            judge.vote([transcript()])
        elapsed = time.monotonic() - start
        assert gave_up.wait(3)  # the connection was dropped, not read on
    assert 1.0 <= elapsed < 3.0  # the whole reply takes over 5 s


def test_https_replies_are_read_through_the_watched_tls_connection(server, tls, tiny_lm_dir):
    server.replies = [(200, completion("Verdict: Alice", "Verdict: Bob"), 0.0)]
    with serving(type("Handler", (ScriptHandler,), {"script": server}), tls) as port:
        judge = remote_judge(f"https://127.0.0.1:{port}/v1", tiny_lm_dir, num_votes=2)
        assert judge.vote([transcript()]).votes.tolist() == [[1.0, 0.0]]
    assert len(server.requests) == 1


def test_the_backoff_doubles_up_to_its_cap():
    server = ChatServer(base_url="http://h/v1", model="m", retries=6, backoff_s=0.5, max_backoff_s=3.0)
    assert [server.backoff(k) for k in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    server = ChatServer(base_url="http://h/v1", model="m", retries=30)  # defaults: 0.5 s doubling, capped at 30 s
    assert sum(server.backoff(k) for k in range(1, 31)) == 0.5 + 1 + 2 + 4 + 8 + 16 + 24 * 30
    assert server.backoff(10**6) == 30.0  # no overflow however many retries


def test_a_failing_server_is_given_up_when_the_total_budget_is_spent(server, tiny_lm_dir):
    """Waits 0.2, 0.3, 0.3 … s after failures: the 6th attempt starts at ~1.4 s, a 7th could not start before 1.7 s."""
    server.replies = [(503, b"overloaded", 0.0)]
    fields = {"retries": 50, "backoff_s": 0.2, "max_backoff_s": 0.3, "total_timeout_s": 1.55}
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, **fields)
    start = time.monotonic()
    with pytest.raises(
        RemoteServerError, match=r"failed \d attempts in its total_timeout_s=1\.55 s; the last: HTTP 503"
    ):
        judge.vote([transcript()])
    assert time.monotonic() - start < 1.55 + 0.5  # no wait is begun that would end past the budget
    gaps = [b - a for a, b in zip(server.times, server.times[1:])]
    assert 2 <= len(server.times) <= 6  # each further attempt needs its wait (0.2 + 0.3 k s) within 1.55 s
    assert all(gap >= judge.server.backoff(k) for k, gap in enumerate(gaps, 1))


def test_the_total_budget_cuts_a_slow_attempt_short(server, tiny_lm_dir):
    server.replies = [(200, completion("Verdict: Bob"), 3.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, timeout_s=10.0, total_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(
        RemoteServerError, match=r"failed 1 attempts in its total_timeout_s=0\.5 s; the last: timed out"
    ):
        judge.vote([transcript()])
    assert time.monotonic() - start < 1.5 and len(server.requests) == 1


@pytest.mark.parametrize(
    "body",
    [
        b"<html>502 from a proxy</html>",
        b"",
        b"{}",
        b'{"choices": "Verdict: Alice"}',
        b'{"choices": [{"message": {"content": 1}}, {"message": null}, 7]}',
        b'{"choices": [{"text": "Verdict: Alice"}]}',
        b"[1, 2, 3]",
        b'"Verdict: Alice"',
    ],
)
def test_garbage_replies_are_unparsed_votes_not_crashes(server, tiny_lm_dir, body):
    server.replies = [(200, body, 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=3)
    out = judge.vote([transcript()])
    assert torch.isnan(out.votes).all() and out.unparseable == 3 and out.invalid == 0
    assert judge.server.malformed == 3 and len(server.requests) == 1  # a 200 garbled is not retried


def test_fewer_choices_than_asked_leave_the_rest_unparsed(server, tiny_lm_dir):
    server.replies = [(200, completion("Verdict: Alice"), 0.0)]
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=3)
    out = judge.vote([transcript()])
    assert out.votes[0, 0].item() == 1.0 and torch.isnan(out.votes[0, 1:]).all()
    assert judge.server.malformed == 2


def test_api_key_comes_from_the_named_variable_and_is_never_stored(server, tiny_lm_dir, monkeypatch):
    server.replies = [(200, completion("Verdict: Alice"), 0.0)]
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", "sekrit-123")
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, api_key_env="JUDGE_KEY_FOR_TEST")
    judge.vote([transcript()])
    assert server.requests[0][1]["Authorization"] == "Bearer sekrit-123"
    assert b"sekrit-123" not in pickle.dumps(judge.server) and b"sekrit-123" not in pickle.dumps(judge.state_dict())
    monkeypatch.delenv("JUDGE_KEY_FOR_TEST")
    with pytest.raises(ValueError, match="JUDGE_KEY_FOR_TEST"):
        judge.vote([transcript()])


KEY = "sekrit-0123456789abcdef0123"


def leaked(err: BaseException, secret: str = KEY) -> list[str]:
    """The 8-character pieces of ``secret`` found in ``err``'s traceback, causes and context included."""
    text = "".join(traceback.format_exception(err)) + repr(err) + repr(err.args)
    return [secret[i : i + 8] for i in range(len(secret) - 7) if secret[i : i + 8] in text]


@pytest.mark.parametrize(
    ("status", "pad", "extra"),
    [
        (400, 0, {}),  # the body echoes every request header
        (400, 300 - len("Authorization: Bearer ") - 10, {}),  # the key's start inside the 300 characters quoted
        (503, 0, {}),  # retried, then quoted as the last failure
        (302, 0, {"Location": "http://elsewhere/?echo=Bearer%20" + KEY.replace("-", "%2D")}),  # urlencoded
    ],
)
def test_a_server_echoing_the_api_key_never_gets_it_into_the_error(tiny_lm_dir, monkeypatch, status, pad, extra):
    class Echo(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            echo = f"Authorization: {self.headers['Authorization']}\n" + json.dumps(dict(self.headers))
            body = ("x" * pad + echo).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for key, value in {**extra, "X-Echo": self.headers["Authorization"]}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", KEY)
    with serving(Echo) as port:
        judge = remote_judge(f"http://127.0.0.1:{port}/v1", tiny_lm_dir, num_votes=1, api_key_env="JUDGE_KEY_FOR_TEST")
        with pytest.raises(RemoteServerError, match=rf"HTTP {status}") as caught:
            judge.vote([transcript()])
    assert leaked(caught.value) == []
    assert "[redacted]" in str(caught.value)  # the server's text is still quoted, the key cut out of it


def test_a_garbled_status_line_echoing_the_key_is_a_failed_attempt_without_the_key(tiny_lm_dir, monkeypatch):
    class Garbled(socketserver.StreamRequestHandler):
        def handle(self):
            lines = iter(self.rfile.readline, b"\r\n")
            auth = next(x for x in lines if x.lower().startswith(b"authorization:")).split(b":", 1)[1].strip()
            self.wfile.write(b"HTTP/1.1 2x0 " + auth + b"\r\n\r\n")

    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", KEY)
    with serving(Garbled) as port:
        url = f"http://127.0.0.1:{port}/v1"
        judge = remote_judge(url, tiny_lm_dir, num_votes=1, retries=1, api_key_env="JUDGE_KEY_FOR_TEST")
        with pytest.raises(RemoteServerError, match=r"failed 2 attempts; the last: BadStatusLine") as caught:
            judge.vote([transcript()])
    assert leaked(caught.value) == [] and REDACTED in str(caught.value)


def test_a_key_split_by_the_read_limit_is_cut_out_too():
    secret = "k" + "0123456789" * 5  # long: its 26 redactions bring the split echo within the quoted characters
    body = "x" * 25 + f"{secret}" * 30
    text = quoted_reply(io.BytesIO(body.encode()), secret)
    assert text == "x" * 25 + REDACTED * 26 and len(text) == 285
    assert leaked(RuntimeError(text), secret) == []


@pytest.mark.parametrize("key", [KEY + "\r\nX-Injected: 1", KEY + " trailing", KEY + "\u2603"])
def test_an_api_key_unfit_for_a_header_is_refused_without_quoting_it(server, tiny_lm_dir, monkeypatch, key):
    server.replies = [(200, completion("Verdict: Alice"), 0.0)]
    monkeypatch.setenv("JUDGE_KEY_FOR_TEST", key)
    judge = remote_judge(server.url, tiny_lm_dir, num_votes=1, api_key_env="JUDGE_KEY_FOR_TEST")
    with pytest.raises(ValueError, match="JUDGE_KEY_FOR_TEST") as caught:
        judge.vote([transcript()])
    assert leaked(caught.value) == [] and server.requests == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"base_url": "judge-host:8000/v1"}, "base_url must start with http"),
        ({"model": ""}, "server.model"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"retries": -1}, "retries"),
        ({"backoff_s": math.inf}, "server.backoff_s"),
        ({"max_backoff_s": -1.0}, "server.max_backoff_s"),
        ({"max_backoff_s": math.nan}, "server.max_backoff_s"),
        ({"max_backoff_s": math.inf}, "server.max_backoff_s"),
        ({"total_timeout_s": 0}, "server.total_timeout_s"),
        ({"total_timeout_s": -5.0}, "server.total_timeout_s"),
        ({"total_timeout_s": math.inf}, "server.total_timeout_s"),
        ({"total_timeout_s": math.nan}, "server.total_timeout_s"),
        ({"samples_per_request": 0}, "samples_per_request"),
    ],
)
def test_bad_server_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ChatServer(**{"base_url": "http://h/v1", "model": "m", **fields})


@pytest.mark.parametrize(
    ("cls", "shared"),
    [
        (HFJudge, PromptedJudge),
        (RemoteJudge, PromptedJudge),
        (LLMJudgeOracle, PromptedOracle),
        (RemoteJudgeOracle, PromptedOracle),
    ],
)
def test_the_prompting_arguments_passed_on_as_kwargs_are_config_options(cls, shared):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(cls, "x")
    options = {a.dest.split(".")[1] for a in parser._actions if a.dest.startswith("x.")}

    def named(c: type) -> set[str]:  # every argument of c and its bases (RemoteClient's too), but **kwargs passed on
        return {
            p.name
            for b in c.__mro__
            if "__init__" in vars(b) and b.__module__.startswith("alignment_games")
            for p in inspect.signature(b.__init__).parameters.values()
            if p.kind is not p.VAR_KEYWORD and p.name != "self"
        }

    assert named(shared) <= named(cls) <= options
    assert {"seed", "timeout_s"} <= named(shared)


def test_a_prefill_is_refused_since_a_chat_reply_cannot_be_started(tiny_lm_dir):
    with pytest.raises(ValueError, match="RemoteJudge: prefill is not supported"):
        RemoteJudge(server={"base_url": "http://h/v1", "model": "m"}, tokenizer=str(tiny_lm_dir), prefill="Verdict:")


def test_remote_oracle_reads_letters_and_leaves_unread_queries_out(server, tiny_lm_dir):
    fields = {"base_url": server.url, "model": "judge", "retries": 0, "timeout_s": 5.0}
    oracle = RemoteJudgeOracle(server=fields, tokenizer=str(tiny_lm_dir), samples=4, max_concurrency=1)
    server.replies = [
        (200, completion("A", " B.", "Response A", "not sure"), 0.0),  # 2 of 3 read say A
        (200, b"garbage", 0.0),  # nothing reads: NaN
    ]
    p = oracle.first_wins_probability(["q1", "q2"], ["a1", "a2"], ["b1", "b2"], None)
    assert p[0].item() == pytest.approx(2 / 3) and math.isnan(p[1].item())
    assert server.requests[0][0]["messages"][0]["content"] == oracle.prompt("q1", "a1", "b1")
    server.replies = [(200, b"{}", 0.0)]
    labels = oracle.label(["q"], ["a"], ["b"])
    assert math.isnan(labels[0].item()) and oracle.invalid_verdicts == 1 and oracle.unlabelled_rows == 1


@pytest.fixture(scope="module")
def transformers_serve(tiny_lm_dir):
    """``transformers serve`` (its ``serving`` extra) on a free local port, serving the tiny Qwen2 folder, offline."""
    import os
    import socket
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    for module in ("fastapi", "uvicorn"):
        pytest.importorskip(module, reason="transformers serve needs its extra: pip install transformers[serving]")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cli = Path(sys.executable).parent / "transformers"
    command = [str(cli), "serve", str(tiny_lm_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("transformers serve did not answer /health within 90 s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # transformers serve takes ~30 s to start on CPU
def test_remote_judge_and_oracle_against_transformers_serve(transformers_serve, tiny_lm_dir):
    # transformers serve ignores n: one completion per request
    fields = {"base_url": transformers_serve, "model": str(tiny_lm_dir), "samples_per_request": 1, "timeout_s": 60}
    judge = RemoteJudge(server=fields, chain_of_thought=False, num_votes=2, sampling=Sampling(max_new_tokens=8))
    out = judge.vote([transcript()])
    assert judge.server.requests == 2 and judge.server.malformed == 0
    assert len(out.texts[0]) == 2 and all(isinstance(t, str) for t in out.texts[0])
    expected = [judge.read_vote(t) for t in out.texts[0]]
    assert torch.equal(torch.isnan(out.votes[0]), torch.isnan(torch.tensor(expected)))
    oracle = RemoteJudgeOracle(server=fields, samples=1)
    p = oracle.first_wins_probability(["q"], ["a"], ["b"], None)
    assert oracle.server.requests == 1 and oracle.server.malformed == 0 and p.shape == (1,)
