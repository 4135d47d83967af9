"""An engine server (`python -m cli serve`) seen from another process, with the engine's own Python methods.

    engine = RemoteEngine("http://127.0.0.1:8000")        # raises EngineUnreachable when nothing answers
    rid = engine.submit(ids, SamplingParams(max_new_tokens=8), retain=True)
    engine.get(rid).status; engine.snapshot().blocks; engine.stats(); engine.fork_many(rid, [[5, 6]])

The console drives the engine through this: the same names and answers as `engine.engine.Engine`
(`submit`, `fork`, `fork_many`, `release`, `reset_cache`, `get`, `requests`, `stats`, `snapshot`,
`check_invariants`, `loaded.model_id`, `num_blocks`, `tokenizer`, ...), so its pages read the same over a
process boundary. Reads come from what the engine published (at most a second old); commands take at
most one engine step. The engine's refusals raise what the engine raises (`ValueError`,
`RequestRejected`, `KeyError`); an engine that does not answer raises `EngineUnreachable`.

`boot_id` names the engine process: it changes when the server restarts its engine (Settings) or the
server itself restarts; `refresh()` reads it again, and the facts with it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import requests

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from engine.core.snapshot import EngineSnapshot, PoolStats, RequestView, ResetResult
from engine.engine import RequestRejected
from engine.engine_process import EngineInfo, PublishedStats
from serving.console_routes import MSGPACK, ForkCommand, StatsAnswer, SubmitCommand, decode, encode

TIMEOUT_S = 60.0  # a command waits for one engine step; a first snapshot for the engine's next step
OWN_COMMANDS_S = 3.0  # after a command of ours, snapshots are taken after it for this long
_ERRORS: dict[str, type[Exception]] = {"RequestRejected": RequestRejected, "KeyError": KeyError}


class EngineUnreachable(RuntimeError):
    """The engine server did not answer (not started, stopped, or its engine process is gone)."""


class RemoteEngine:
    """An engine process behind an engine server's `/engine/...` routes (see the module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self._http = requests.Session()
        self._timeout_s = timeout_s
        self._commanded_at = float("-inf")  # monotonic time of our newest command
        self._tokenizer: Any = None
        self._tokenizer_for: EngineConfig | None = None
        self.refresh()

    # ------------------------------------------------------------------ facts
    def refresh(self) -> None:
        """Read the engine's facts again (after a restart of the engine or of its server)."""
        answer = self._get("/engine/info")
        self.info: EngineInfo = decode(encode(answer["info"]), EngineInfo)
        self.config: EngineConfig = decode(encode(answer["config"]), EngineConfig)
        self.boot_id: str = answer["boot_id"]
        self.db_url: str | None = answer["db_url"]
        self._failure: str | None = answer["failure"]
        info = self.info
        self.loaded = SimpleNamespace(model_id=info.model_id, weights_revision=info.weights_revision,
                                      device=info.device, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads,
                                      head_dim=info.head_dim, num_parameters=info.num_parameters,
                                      attention_spec=info.attention_spec,
                                      max_position_embeddings=info.max_model_len)  # fmt: skip
        self.runner = SimpleNamespace(forward_path=info.forward_path,
                                      kernels=SimpleNamespace(summary=lambda: info.kernels))  # fmt: skip

    def current_boot_id(self) -> str:
        """The boot id the server reports now (differs from `boot_id` after a restart)."""
        return self._get("/engine/info")["boot_id"]

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving, as of the last `refresh`, or None."""
        return self._failure

    @property
    def num_blocks(self) -> int:
        return self.info.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def run_id(self) -> str | None:
        return self.info.run_id

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded in this process (None for token-id-only models)."""
        if self._tokenizer_for != self.config:
            from engine.runner.model_loading import load_tokenizer

            self._tokenizer, self._tokenizer_for = load_tokenizer(self.config), self.config
        return self._tokenizer

    # ------------------------------------------------------------------ commands
    def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        retain: bool = False,
        salt: str | None = None,
    ) -> str:
        command = SubmitCommand(list(prompt_token_ids), sampling or SamplingParams(), request_id, retain, salt)
        return self._post("/engine/submit", encode(command))

    def fork(
        self,
        parent_id: str,
        suffix_token_ids: list[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        retain: bool = False,
    ) -> str:
        ids = None if request_id is None else [request_id]
        return self.fork_many(parent_id, [suffix_token_ids], sampling, request_ids=ids, retain=retain)[0]

    def fork_many(
        self,
        parent_id: str,
        suffixes: list[list[int]],
        sampling: SamplingParams | None = None,
        *,
        request_ids: list[str] | None = None,
        retain: bool = False,
    ) -> list[str]:
        command = ForkCommand(parent_id, [list(s) for s in suffixes], sampling or SamplingParams(), request_ids, retain)
        return self._post("/engine/fork", encode(command))

    def release(self, request_id: str) -> None:
        self._post(f"/engine/release/{request_id}")

    def reset_cache(self) -> ResetResult:
        return decode(encode(self._post("/engine/reset")), ResetResult)

    def check_invariants(self) -> None:
        self._post("/engine/check")

    def restart(self, config: EngineConfig) -> None:
        """Replace the server's engine process with one built from `config` (its Settings' restart).

        Raises:
            ValueError: the new engine could not start; the old one still serves.
        """
        answer = self._post("/engine/restart", encode(config), timeout=None)
        del answer
        self.refresh()

    # ------------------------------------------------------------------ reading
    def get(self, request_id: str) -> RequestView:
        return decode(self._raw("GET", f"/engine/requests/{request_id}"), RequestView)

    def requests(self) -> list[RequestView]:
        """Live, retained and recently ended requests, from the newest published snapshot (no step waited for)."""
        return list(self.snapshot().requests)

    def published(self) -> PublishedStats:
        """The engine's newest counters, forward threads and history writer progress."""
        answer = decode(self._raw("GET", "/engine/stats"), StatsAnswer)
        if answer.published is None:
            raise EngineUnreachable("the engine has published no stats yet")
        return answer.published

    def stats(self) -> PoolStats:
        return self.published().pool

    def stats_history(self) -> list[tuple[float, PoolStats]]:
        """The server's bounded ring of (epoch seconds, counters) samples (the Overview's charts)."""
        return decode(self._raw("GET", "/engine/stats"), StatsAnswer).history

    def forward_threads(self) -> int:
        return self.published().forward_threads

    def forward_time_at_threads(self) -> dict[int, float]:
        return self.published().forward_seconds

    def writer_mark(self) -> int | None:
        """The history writer's mark for every row the engine handed it so far (None: no history)."""
        return self._post("/engine/writer_mark")

    def snapshot(self) -> EngineSnapshot:
        """The newest published snapshot; for OWN_COMMANDS_S after a command of ours, one taken after it
        (a page that just submitted lists its request)."""
        ours = time.monotonic() - self._commanded_at < OWN_COMMANDS_S
        return decode(self._raw("GET", "/engine/snapshot" + ("?after_commands=true" if ours else "")), EngineSnapshot)

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ transport
    def _get(self, path: str) -> Any:
        return decode(self._raw("GET", path))

    def _post(self, path: str, body: bytes = b"", timeout: float | None = TIMEOUT_S) -> Any:
        """A command: its answer, and later snapshots taken after it for a while."""
        try:
            return decode(self._raw("POST", path, body, timeout))
        finally:
            self._commanded_at = time.monotonic()

    def _raw(self, method: str, path: str, body: bytes = b"", timeout: float | None = TIMEOUT_S) -> bytes:
        try:
            response = self._http.request(method, self.url + path, data=body, headers={"Content-Type": MSGPACK},
                                          timeout=timeout if timeout is None else min(timeout, self._timeout_s))  # fmt: skip
        except requests.RequestException as exc:
            raise EngineUnreachable(f"the engine server at {self.url} did not answer: {exc}") from None
        if response.status_code == 200:
            return response.content
        try:
            error = decode(response.content)
            kind, message = error["kind"], error["message"]
        except Exception:  # not an engine server's answer (another program on the port)
            raise EngineUnreachable(f"{self.url}{path} answered {response.status_code}") from None
        if response.status_code == 503 or kind == "EngineGone":
            self._failure = message
            raise EngineUnreachable(message)
        raise _ERRORS.get(kind, ValueError)(message)


def wait_for_server(url: str, timeout_s: float) -> RemoteEngine:
    """A RemoteEngine once the server at `url` answers (it binds only once its engine is loaded).

    Raises:
        EngineUnreachable: it did not answer within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return RemoteEngine(url)
        except EngineUnreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)
