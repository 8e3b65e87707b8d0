"""A stand-in for an SGLang server, for tests only: SGLang cannot run on this machine (no GPU).

It is a real HTTP server (`ThreadingHTTPServer` on 127.0.0.1, a free port) that speaks SGLang's
native API with SGLang's own field names and answer shapes (the sources are listed in
`agent/models/sglang_api.py`), but it reads raw JSON itself rather than the client's structs, so a
misspelt field on the client side fails here as it would against SGLang.

Behind the API:

- a deterministic toy "model": the next token is a hash of the last tokens (and of `sampling_seed`
  when sampling), a byte 0-255, or EOS when the hash says so; the vocabulary is the byte tokenizer's;
- a radix-style prefix cache: a trie of token ids per `cache_salt`, so `cached_tokens` is honestly
  the longest cached prefix (capped at `prompt_tokens - 1`, as SGLang never serves the last prompt
  token), filled after each request with its input and all but its last output token;
- sessions (`/open_session`, `/close_session`, `session_params` with `id`, `rid`, `offset`,
  `replace`), following `session_controller.py`;
- switches that inject failures: an HTTP error status, an abort finish reason, a delay past the
  client's timeout, an unhealthy `/health`, a `/flush_cache` refused while "busy".
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent.models.tokenizer import ByteTokenizer


class _TrieNode:
    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}


class RadixCacheStandIn:
    """Token-id prefixes per cache salt; a salt never matches another salt's entries."""

    def __init__(self) -> None:
        self._roots: dict[str | None, _TrieNode] = {}
        self._lock = threading.Lock()

    def match(self, salt: str | None, ids: list[int]) -> int:
        """Length of the longest cached prefix of `ids` under `salt`."""
        with self._lock:
            node = self._roots.get(salt)
            depth = 0
            while node is not None and depth < len(ids):
                node = node.children.get(ids[depth])
                if node is not None:
                    depth += 1
            return depth

    def insert(self, salt: str | None, ids: list[int]) -> None:
        """Cache every prefix of `ids` under `salt`."""
        with self._lock:
            node = self._roots.setdefault(salt, _TrieNode())
            for token in ids:
                node = node.children.setdefault(token, _TrieNode())

    def flush(self) -> None:
        """Forget every entry under every salt."""
        with self._lock:
            self._roots.clear()


@dataclass
class _SessionNode:
    context: list[int]
    parent: str | None
    children: list[str] = field(default_factory=list)


@dataclass
class _Switches:
    fail_status: int | None = None
    fail_times: int = 0
    abort_message: str | None = None
    abort_times: int = 0
    delay_s: float = 0.0
    unhealthy: bool = False
    busy: bool = False


class _BadRequest(Exception):
    pass


class SGLangStandIn:
    """The stand-in server; use as a context manager, or `start()` / `stop()`."""

    model_path = "standin/byte-toy"

    def __init__(self, *, eos_every: int = 6) -> None:
        self.tokenizer = ByteTokenizer()
        self.eos_token_id = self.tokenizer.eos_token_id
        self.eos_every = eos_every
        self.radix = RadixCacheStandIn()
        self.sessions: dict[str, dict[str, _SessionNode]] = {}
        self.generate_bodies: list[dict[str, Any]] = []
        self.switches = _Switches()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        handler = type("SGLangStandInHandler", (_Handler,), {"standin": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL of the running stand-in."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> SGLangStandIn:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port; delayed answers are cut short."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> SGLangStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail_next(self, status: int = 500, times: int = 1) -> None:
        """Answer the next `times` generate requests with HTTP `status`."""
        self.switches.fail_status, self.switches.fail_times = status, times

    def abort_next(self, message: str = "Abort requested by the stand-in", times: int = 1) -> None:
        """Finish the next `times` generate requests with an abort finish reason (HTTP 200)."""
        self.switches.abort_message, self.switches.abort_times = message, times

    def next_token(self, context: list[int], seed: int | None) -> int:
        """The toy model: a hash of the last 16 tokens (and the seed) picks a byte, or EOS."""
        tail = b",".join(str(t).encode() for t in context[-16:])
        salt = b"" if seed is None else f"seed={seed}".encode()
        h = int.from_bytes(hashlib.blake2b(tail + b"|" + salt, digest_size=8).digest(), "big")
        return self.eos_token_id if h % self.eos_every == 0 else (h >> 8) % 256

    # --- endpoints -------------------------------------------------------------------------------

    def generate(self, body: dict[str, Any]) -> tuple[int, Any]:
        """`POST /generate`: resolve the context, match the radix cache, run the toy model."""
        self.generate_bodies.append(body)
        self._stopping.wait(self.switches.delay_s)
        failure = self._take_failure()
        if failure is not None:
            return failure, {"object": "error", "message": "injected failure", "type": str(failure)}
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not input_ids:
            raise _BadRequest("input_ids cannot be empty.")
        rid = body.get("rid") or uuid.uuid4().hex
        params = body.get("sampling_params") or {}
        salt = body.get("cache_salt")
        with self._lock:
            context = self._session_context(body.get("session_params"), list(input_ids))
        if context is None:
            return 200, _answer(rid, [], _abort("Invalid request session id"), len(input_ids), 0)
        if self._take_abort():
            reason = _abort(self.switches.abort_message or "aborted")
            return 200, _answer(rid, [], reason, len(context), 0)
        cached = min(self.radix.match(salt, context), len(context) - 1)
        output, reason = self._run_model(context, params)
        self.radix.insert(salt, (context + output)[:-1])
        with self._lock:
            self._register(body.get("session_params"), rid, context + output)
        answer = _answer(rid, output, reason, len(context), cached)
        answer["text"] = self.tokenizer.decode(output)
        return 200, answer

    def open_session(self, body: dict[str, Any]) -> tuple[int, Any]:
        """`POST /open_session`: answers the session id as a JSON string."""
        if "capacity_of_str_len" not in body:
            raise _BadRequest("capacity_of_str_len is required")
        session_id = body.get("session_id") or uuid.uuid4().hex
        with self._lock:
            if session_id in self.sessions:
                raise _BadRequest("Failed to open the session. Check if a session with the same id is still open.")
            self.sessions[session_id] = {}
        return 200, session_id

    def close_session(self, body: dict[str, Any]) -> tuple[int, Any]:
        """`POST /close_session`."""
        with self._lock:
            self.sessions.pop(str(body.get("session_id")), None)
        return 200, None

    def flush_cache(self) -> tuple[int, Any]:
        """`POST /flush_cache`: refused (400) while the stand-in plays busy."""
        if self.switches.busy:
            return 400, "Cache not flushed: requests are running.\n"
        self.radix.flush()
        return 200, "Cache flushed.\n"

    def model_info(self) -> tuple[int, Any]:
        """`GET /get_model_info`."""
        return 200, {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    def tokenize(self, body: dict[str, Any]) -> tuple[int, Any]:
        """`POST /tokenize`: special-token spellings are parsed, as a real tokenizer does."""
        ids = self.tokenizer.encode(str(body["prompt"]), specials=True)
        if body.get("add_special_tokens", True):
            ids = [self.tokenizer.bos_token_id, *ids]
        return 200, {"tokens": ids, "count": len(ids), "max_model_len": 4096}

    def detokenize(self, body: dict[str, Any]) -> tuple[int, Any]:
        """`POST /detokenize`."""
        return 200, {"text": self.tokenizer.decode([int(t) for t in body["tokens"]])}

    # --- internals -------------------------------------------------------------------------------

    def _take_failure(self) -> int | None:
        with self._lock:
            if self.switches.fail_times <= 0 or self.switches.fail_status is None:
                return None
            self.switches.fail_times -= 1
            return self.switches.fail_status

    def _take_abort(self) -> bool:
        with self._lock:
            if self.switches.abort_times <= 0:
                return False
            self.switches.abort_times -= 1
            return True

    def _session_context(self, params: dict[str, Any] | None, input_ids: list[int]) -> list[int] | None:
        """The request's full context; None where SGLang would abort the request."""
        if params is None:
            return input_ids
        nodes = self.sessions.get(str(params.get("id")))
        if nodes is None:
            raise _BadRequest(f"session id {params.get('id')} does not exist")
        parent = params.get("rid")
        if parent is not None and parent not in nodes:
            return None
        if params.get("replace"):
            victims = list(nodes) if parent is None else list(nodes[parent].children)
            for victim in victims:
                _drop_subtree(nodes, victim)
            if parent is not None:
                nodes[parent].children.clear()
        if parent is None:
            return input_ids
        context = list(nodes[parent].context)
        offset = params.get("offset")
        # SGLang applies the offset only when it is non-zero: 0 means append.
        if offset:
            context = context[:offset]
        return context + input_ids

    def _register(self, params: dict[str, Any] | None, rid: str, context: list[int]) -> None:
        if params is None:
            return
        nodes = self.sessions.get(str(params.get("id")))
        if nodes is None:
            return
        parent = params.get("rid")
        nodes[rid] = _SessionNode(context=context, parent=parent)
        if parent is not None and parent in nodes:
            nodes[parent].children.append(rid)

    def _run_model(self, context: list[int], params: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        max_new = int(params.get("max_new_tokens", 128))
        stops = {int(t) for t in params.get("stop_token_ids") or []} | {self.eos_token_id}
        sampled = float(params.get("temperature", 1.0)) > 0.0
        seed = params.get("sampling_seed") if sampled else None
        output: list[int] = []
        for _ in range(max_new):
            token = self.next_token(context + output, seed)
            output.append(token)
            if token in stops:
                return output, {"type": "stop", "matched": token}
        return output, {"type": "length", "length": max_new}


def _drop_subtree(nodes: dict[str, _SessionNode], rid: str) -> None:
    node = nodes.pop(rid, None)
    if node is None:
        return
    for child in node.children:
        _drop_subtree(nodes, child)


def _abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def _answer(rid: str, output: list[int], reason: dict[str, Any], prompt: int, cached: int) -> dict[str, Any]:
    return {
        "text": "",
        "output_ids": output,
        "meta_info": {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": prompt,
            "completion_tokens": len(output),
            "cached_tokens": cached,
            "e2e_latency": 0.0,
        },
    }


class _Handler(BaseHTTPRequestHandler):
    """Routes SGLang's paths to the stand-in bound as the class attribute `standin`."""

    standin: SGLangStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
            status, payload = self._route(method, self.path, body)
        except (_BadRequest, ValueError, KeyError, TypeError) as exc:
            status, payload = 400, {"error": {"message": str(exc)}}
        self._send(status, payload)

    def _route(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        standin = self.standin
        if path == "/health" and method == "GET":
            return (503 if standin.switches.unhealthy else 200), None
        if path == "/get_model_info" and method == "GET":
            return standin.model_info()
        if path == "/flush_cache":
            return standin.flush_cache()
        routes = {
            "/generate": standin.generate,
            "/open_session": standin.open_session,
            "/close_session": standin.close_session,
            "/tokenize": standin.tokenize,
            "/detokenize": standin.detokenize,
        }
        if method == "POST" and path in routes:
            return routes[path](body)
        return 404, {"detail": "Not Found"}

    def _send(self, status: int, payload: Any) -> None:
        if payload is None:
            data, kind = b"", "text/plain"
        elif isinstance(payload, str) and self.path == "/flush_cache":
            data, kind = payload.encode(), "text/plain"
        else:
            data, kind = json.dumps(payload).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
