"""A standard-library client of an OpenAI-compatible chat-completions server (what it refuses: docs/trust.md)."""

from __future__ import annotations

import functools
import http.client
import json
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from alignment_games.modules.algorithms.checks import require_at_least

#: Bytes of a reply read at most; a longer body is malformed (a hostile server cannot fill the memory).
MAX_REPLY_BYTES = 8 * 2**20
QUOTED_CHARS = 300  #: Characters of a server's error text quoted in a message at most.
REDACTED = "[redacted]"  #: What an API key is replaced with in quoted server text.
# a key sent as one header token: printable ASCII, no space (a line break would inject headers)
_HEADER_TOKEN = re.compile(r"[!-~]+")


def _key_forms(secret: str) -> list[str]:
    """How a server may echo ``secret``: literally, JSON-escaped or percent-encoded."""
    return list(dict.fromkeys([secret, json.dumps(secret)[1:-1], urllib.parse.quote(secret, safe="")]))


def redacted(text: str, secret: str | None) -> str:
    """``text`` with every echo of ``secret`` (:func:`_key_forms`, or percent-encoded otherwise) replaced."""
    if not secret:
        return text
    for form in _key_forms(secret):
        text = text.replace(form, REDACTED)
    if secret in urllib.parse.unquote(text):  # percent-encoded another way: quote the decoded text
        text = urllib.parse.unquote(text).replace(secret, REDACTED)
    return text


def quoted_reply(reply: Any, secret: str | None) -> str:
    """The start of an error reply's body, at most :data:`QUOTED_CHARS` characters, ``secret`` cut out of it.

    Enough bytes are read that a key starting within the quoted characters is read whole; a read that stops inside an
    echo of the key drops that echo's start.
    """
    limit = 4 * QUOTED_CHARS + 3 * len(secret or "")
    raw = reply.read(limit)
    text = raw.decode(errors="replace")
    if secret and len(raw) == limit:
        for form in _key_forms(secret):
            cut = next((k for k in range(min(len(form), len(text) + 1) - 1, 0, -1) if text.endswith(form[:k])), 0)
            text = text[: len(text) - cut]
    return redacted(text, secret)[:QUOTED_CHARS]


class RemoteServerError(RuntimeError):
    """A chat-completions server that failed every attempt, or refused a request."""


class _Watchdog:
    """Shuts the sockets of one attempt down at its monotonic ``deadline``, waking any read blocked on them."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self._socks, self._lock, self._fired = deadline, [], threading.Lock(), False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed (a read it cut short may look like a short reply: never trust one)."""
        return self._fired or time.monotonic() >= self.deadline

    def watch(self, sock: socket.socket) -> None:
        """Shut ``sock`` down at the deadline (at once when it has passed)."""
        with self._lock:
            self._socks.append(sock)
            fired = self._fired
        if fired:
            self._shut(sock)

    def cancel(self) -> None:
        """Stop the timer: the attempt is over."""
        self._timer.cancel()

    def _fire(self) -> None:
        with self._lock:
            self._fired, socks = True, list(self._socks)
        for sock in socks:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        try:  # the plain socket's shutdown, also under TLS: it works on the descriptor, whoever reads it
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:  # already closed
            pass


class _Watched:
    """Mixin of an ``http.client`` connection whose sockets a :class:`_Watchdog` shuts down at the deadline."""

    def __init__(self, *args: Any, watchdog: _Watchdog, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watchdog = watchdog
        self._create_connection = self._watched_connection

    def _watched_connection(self, *args: Any, **kwargs: Any) -> socket.socket:
        sock = socket.create_connection(*args, **kwargs)
        self.watchdog.watch(sock)  # a proxy tunnel is read on it
        return sock

    def connect(self) -> None:
        """Connect, then watch the socket that is read (the TLS one under HTTPS)."""
        super().connect()
        self.watchdog.watch(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
    """The HTTP connection, watched."""


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
    """The HTTPS connection, watched (its handshake is bounded by the socket timeout, the time left)."""


class _WatchedHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """Opens the HTTP and HTTPS connections of one attempt, watched by its :class:`_Watchdog`."""

    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self.watchdog = watchdog

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTP, watchdog=self.watchdog), req)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTPS, watchdog=self.watchdog), req)


class _Failed(Exception):
    """One failed attempt worth retrying, with what to report of it (already free of the key)."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: a 3xx reply reaches the caller as an ``HTTPError`` (urllib would re-send the headers)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl) -> None:
        return None


@dataclass
class ChatServer:
    """Where and how to ask a chat-completions server.

    Args:
        base_url: The API root, e.g. ``http://judge-host:8000/v1`` (``/chat/completions`` is appended).
        model: The served model's name, sent as ``model``.
        api_key_env: Name of the environment variable holding the API key (``None``: no key is sent).
        timeout_s: Wall-clock seconds one attempt may take, connection to last byte, before it fails (and is retried).
        retries: Further attempts after a failed one (connection error, timeout, HTTP 429 or 5xx).
        backoff_s: Wait before the first retry; doubled at each further one (:meth:`backoff`).
        max_backoff_s: The longest wait between two attempts.
        total_timeout_s: Wall-clock seconds one :meth:`complete` call (requests, attempts, waits) may take; an attempt
            is cut off there, no wait begun that would end past it. ``None``: no such budget.
        samples_per_request: Completions asked per request (``n``); 1 for servers that ignore ``n``.

    Attributes:
        malformed: Completions a reply should have carried but did not.
        requests: Requests answered (after retries).
    """

    base_url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    total_timeout_s: float | None = None
    samples_per_request: int = 8
    malformed: int = field(default=0, init=False)
    requests: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"server.base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise ValueError("server.model must name the served model")
        seconds = {"timeout_s": True, "backoff_s": False, "max_backoff_s": False}
        if self.total_timeout_s is not None:
            seconds["total_timeout_s"] = True
        for name, positive in seconds.items():
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and (value > 0 if positive else value >= 0) and value < math.inf):
                kind = "positive" if positive else "non-negative"
                raise ValueError(f"server.{name} must be a finite {kind} number of seconds, got {value!r}")
        least = {"retries": 0, "samples_per_request": 1}
        require_at_least(**{f"server.{k}": (getattr(self, k), m) for k, m in least.items()})

    @property
    def url(self) -> str:
        """The chat-completions endpoint."""
        return self.base_url.rstrip("/") + "/chat/completions"

    def _api_key(self) -> str | None:
        """The API key, read from the environment now (``None`` when none is sent); its value is never quoted."""
        if self.api_key_env is None:
            return None
        if not (key := os.environ.get(self.api_key_env)):
            raise ValueError(f"server.api_key_env names {self.api_key_env!r}, which is not set in the environment")
        if not _HEADER_TOKEN.fullmatch(key):
            raise ValueError(
                f"server.api_key_env names {self.api_key_env!r}, whose value is not printable ASCII without spaces or "
                "line breaks (it would break the Authorization header); the value is not shown"
            )
        return key

    def backoff(self, retry: int) -> float:
        """The wait before retry ``retry`` (1 for the first): ``backoff_s · 2^(retry-1)``, at most ``max_backoff_s``."""
        return min(self.backoff_s * 2.0 ** min(retry - 1, 1000), self.max_backoff_s)

    def _post(self, payload: dict, budget_end: float = math.inf) -> bytes:
        """The body of a successful reply, after up to ``retries`` retries, before the monotonic ``budget_end``."""
        data, last = json.dumps(payload).encode(), ""
        for attempt in range(self.retries + 1):
            if attempt:
                wait = self.backoff(attempt)
                if time.monotonic() + wait >= budget_end:
                    break
                time.sleep(wait)
            start = time.monotonic()
            if start >= budget_end:
                break
            bound = "timeout_s" if start + self.timeout_s <= budget_end else "total_timeout_s"
            late = f"timed out: no whole reply within {bound}={getattr(self, bound)} s"
            try:
                return self._attempt(data, min(start + self.timeout_s, budget_end), late)
            except _Failed as failed:
                last = str(failed)
        else:
            raise RemoteServerError(f"{self.url} failed {self.retries + 1} attempts; the last: {last}")
        spent = f"in its total_timeout_s={self.total_timeout_s} s"
        last = last or "none made, the call's earlier requests spent the budget"
        raise RemoteServerError(f"{self.url} failed {attempt} attempts {spent}; the last: {last}")

    def _attempt(self, data: bytes, deadline: float, late: str) -> bytes:
        """One request, whole before the monotonic ``deadline``: ``_Failed`` to retry, else a refusal raised."""
        key = self._api_key()
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        watchdog = _Watchdog(deadline)
        opener = urllib.request.build_opener(_RefuseRedirects, _WatchedHandler(watchdog))
        try:
            with opener.open(request, timeout=max(deadline - time.monotonic(), 1e-3)) as reply:
                body = bytearray()
                while len(body) <= MAX_REPLY_BYTES and not watchdog.expired:
                    if not (chunk := reply.read1(min(2**16, MAX_REPLY_BYTES + 1 - len(body)))):
                        break
                    body += chunk
            if watchdog.expired:  # a read the watchdog cut short ends like a whole reply
                raise _Failed(late)
            return bytes(body)
        except urllib.error.HTTPError as err:
            if 300 <= err.code < 400:
                location = redacted(err.headers.get("Location") or "", key)[:QUOTED_CHARS]
                raise RemoteServerError(
                    f"{self.url} answered HTTP {err.code} redirect to {location!r} refused: requests go to "
                    "server.base_url only (with the API key); set it to the address that answers"
                ) from None
            detail = quoted_reply(err, key)
            if watchdog.expired:
                raise _Failed(late) from None
            if err.code != 429 and err.code < 500:
                raise RemoteServerError(f"{self.url} refused the request: HTTP {err.code}: {detail}") from None
            raise _Failed(f"HTTP {err.code}: {detail}") from None
        except (OSError, http.client.HTTPException) as err:  # URLError, timeouts, resets, garbled status lines
            if watchdog.expired:
                raise _Failed(late) from None
            # the reason may quote the server (a malformed status line): the key is cut out of it too
            raise _Failed(
                redacted(f"{type(err).__name__}: {getattr(err, 'reason', err)}", key)[:QUOTED_CHARS]
            ) from None
        finally:
            watchdog.cancel()

    def _texts(self, body: bytes, n: int) -> list[str | None]:
        """The ``n`` completions of a reply body, ``None`` for each one missing or malformed."""
        try:
            choices = json.loads(body)["choices"] if len(body) <= MAX_REPLY_BYTES else None
        except (ValueError, TypeError, KeyError, IndexError):
            choices = None
        if not isinstance(choices, list):
            choices = []
        out: list[str | None] = []
        for choice in choices[:n]:
            message = choice.get("message") if isinstance(choice, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            out.append(content if isinstance(content, str) else None)
        out += [None] * (n - len(out))
        self.malformed += sum(t is None for t in out)
        return out

    def complete(
        self,
        messages: Sequence[dict[str, str]],
        n: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 256,
        seeds: Sequence[int] | None = None,
    ) -> list[str | None]:
        """``n`` sampled completions of one chat (``None`` where a reply lacked one), with one API ``seed`` a request.

        Raises:
            RemoteServerError: naming the URL when a request failed all its attempts or was refused.
        """
        budget_end = math.inf if self.total_timeout_s is None else time.monotonic() + self.total_timeout_s
        out: list[str | None] = []
        for k, start in enumerate(range(0, n, self.samples_per_request)):
            ask = min(self.samples_per_request, n - start)
            payload = {"model": self.model, "messages": list(messages), "n": ask, "temperature": temperature}
            payload |= {"top_p": top_p, "max_tokens": max_tokens, "stream": False}
            if seeds is not None:
                payload["seed"] = int(seeds[k])
            out += self._texts(self._post(payload, budget_end), ask)
            self.requests += 1
        return out


class RemoteClient:
    """Mixin of a prompted judge or oracle served by a chat-completions server, before its prompted base in the bases.

    Args:
        server: Where and how to ask (:class:`ChatServer`, or its fields as a dict).
        tokenizer: The served model's tokenizer (default: ``server.model``), to count tokens and quote special ones.
        max_concurrency: Transcripts or queries asked at once (the server batches concurrent requests).
        trust_remote_code: For the tokenizer; off unless turned on.
        **prompting: The prompted base's arguments, passed on.
    """

    generator: torch.Generator  # the prompted base's

    def __init__(
        self,
        server: ChatServer | dict,
        tokenizer: str | None = None,
        max_concurrency: int = 8,
        trust_remote_code: bool = False,
        **prompting: Any,
    ) -> None:
        super().__init__(**prompting)
        from alignment_games.modules.lm.models import load_tokenizer

        self.server = server if isinstance(server, ChatServer) else ChatServer(**server)
        require_at_least(max_concurrency=(max_concurrency, 1))
        self.max_concurrency = max_concurrency
        self.tokenizer = load_tokenizer(tokenizer or self.server.model, trust_remote_code=trust_remote_code)

    def ask_each(self, texts: Sequence[str], n: int, temperature: float, top_p: float, max_tokens: int) -> list[list]:
        """``n`` completions of each text as the user message, ``max_concurrency`` at once, seeded by ``generator``."""
        requests = -(-n // self.server.samples_per_request)  # what complete sends for n completions: a seed each
        seeds = torch.randint(0, 2**31 - 1, (len(texts), requests), generator=self.generator)

        def ask(i: int) -> list[str | None]:
            chat = [{"role": "user", "content": texts[i]}]
            return self.server.complete(chat, n, temperature, top_p, max_tokens, seeds[i].tolist())

        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            return list(pool.map(ask, range(len(texts))))
