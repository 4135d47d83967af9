"""The console's door into an engine server: `/engine/...` routes beside the OpenAI-compatible API.

    GET  /engine/info              the engine's fixed facts, its boot id and its failure (if any)
    GET  /engine/snapshot          every block and live or recent request, and the disk tier's newest blocks
                                   with the pool blocks it filled (`TierView`), at most a second old
                                   (?after_commands=true: taken after every command sent so far)
    GET  /engine/stats             the newest counters (with the history writer's progress) and the
                                   bounded ring of samples the Overview draws
    GET  /engine/requests          live, retained and recently ended requests (asked of the engine)
    GET  /engine/requests/{id}     one of them
    POST /engine/submit | fork | release/{id} | reset | restart | check | writer_mark

Bodies and answers are msgpack (msgspec), decoded by the console into the engine's own types
(`RequestView`, `EngineSnapshot`, `PoolStats`, `EngineConfig`, `SamplingParams`: their checks run on
decoding). A command the engine refuses answers 400 with `{"kind": <exception type>, "message": ...}`;
an engine process that is gone answers 503. Reads are served from what the engine published (snapshot,
stats): none waits for a forward. Commands wait for the engine's reply on the event loop, so they take
at most one step; nothing else waits meanwhile.

`EngineHolder` keeps the current engine process; `restart` builds the new one first (the old one serves
meanwhile), then ends the old one's unfinished requests (RESTART_REASON) and stops it.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.core.config import EngineConfig, shares_disk_tier
from engine.core.request import SamplingParams
from engine.core.snapshot import PoolStats
from engine.engine_process import WRITER_MARK, PublishedStats
from serving.engine_client import EngineClient, EngineCommandError, EngineGone

MSGPACK = "application/msgpack"
RESTART_REASON = "the engine was restarted"  # finish reason of the requests a restart aborts
MAX_COMMAND_BYTES = 4 * 2**20


def _dec_hook(kind: type, value: Any) -> Any:
    if kind is Path:
        return Path(value)
    raise NotImplementedError(f"cannot decode {kind}")


def _enc_hook(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(value: Any) -> bytes:
    return ENCODER.encode(value)


def decode(data: bytes, kind: Any = Any) -> Any:
    return msgspec.msgpack.decode(data, type=kind, dec_hook=_dec_hook)


class SubmitCommand(msgspec.Struct, frozen=True):
    prompt_token_ids: list[int]
    sampling: SamplingParams
    request_id: str | None = None
    retain: bool = False
    salt: str | None = None


class ForkCommand(msgspec.Struct, frozen=True):
    parent_id: str
    suffixes: list[list[int]]
    sampling: SamplingParams
    request_ids: list[str] | None = None
    retain: bool = False


class StatsAnswer(msgspec.Struct, frozen=True):
    published: PublishedStats | None  # None until the engine's first stats
    history: list[tuple[float, PoolStats]]


class EngineHolder:
    """The engine process the server runs now, and its replacement on restart."""

    def __init__(self, client: EngineClient, db_url: str | None) -> None:
        self._client = client
        self.db_url = db_url
        self._restart_lock = threading.Lock()

    def current(self) -> EngineClient:
        return self._client

    def restart(self, config: EngineConfig) -> EngineClient:
        """A new engine process from `config`; the old one ends its requests and stops once the new one is up.

        On the old one's disk tier directory the order turns round (the tier opens in one process at a time):
        the old one stops first, writing its pool's cached blocks to the tier, then the new one starts warm;
        when it cannot, an engine of the old configuration is started again (warm) before the error.

        Raises:
            EngineGone: the new one could not start (the old one, or one of its configuration, serves on).
        """
        with self._restart_lock:
            old = self._client
            if not shares_disk_tier(old.config, config):
                new = EngineClient.start(config, db_url=self.db_url)
                self._client = new
                old.close(reason=RESTART_REASON)
                return new
            old.close(reason=RESTART_REASON)
            try:
                self._client = EngineClient.start(config, db_url=self.db_url)
            except EngineGone:
                self._client = EngineClient.start(old.config, db_url=self.db_url)
                raise
            return self._client

    def close(self) -> None:
        self._client.close()


def _answer(value: Any, status: int = 200) -> Response:
    return Response(encode(value), status_code=status, media_type=MSGPACK)


def _refused(kind: str, message: str, status: int = 400) -> Response:
    return _answer({"kind": kind, "message": message}, status)


async def refusal_handler(_: Request, exc: Exception) -> Response:
    """The app's handler of `Refused`: a 400 the console's client raises as ValueError."""
    return _refused("ValueError", str(exc))


async def _command(client: EngineClient, name: str, *args: Any, **kwargs: Any) -> Response:
    try:
        return _answer(await client.call_async(name, *args, **kwargs))
    except EngineCommandError as exc:
        return _refused(exc.kind, str(exc))
    except EngineGone as exc:
        return _refused("EngineGone", str(exc), 503)


class Refused(Exception):
    """A command body that does not decode: answered 400 with the decoder's message."""


async def _decoded(request: Request, kind: Any) -> Any:
    """The body as `kind` (at most MAX_COMMAND_BYTES; `kind`'s own checks run), else `Refused`."""
    data = await request.body()
    if len(data) > MAX_COMMAND_BYTES:
        raise Refused(f"a command body is at most {MAX_COMMAND_BYTES} bytes")
    try:
        return decode(data, kind)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise Refused(str(exc)) from None


def console_router(holder: EngineHolder) -> APIRouter:
    """The `/engine/...` routes over `holder`'s engine; the app must answer `Refused` (`refusal_handler`)."""
    router = APIRouter(prefix="/engine")

    @router.get("/info")
    async def info() -> Response:
        client = holder.current()
        return _answer({"info": client.info, "config": client.config, "boot_id": client.boot_id,
                        "failure": client.failure, "db_url": holder.db_url})  # fmt: skip

    @router.get("/snapshot")
    async def snapshot(after_commands: bool = False) -> Response:
        try:
            client = holder.current()
            return _answer(await asyncio.to_thread(client.snapshot, after_commands=after_commands))
        except EngineGone as exc:
            return _refused("EngineGone", str(exc), 503)

    @router.get("/stats")
    async def stats() -> Response:
        client = holder.current()
        return _answer(StatsAnswer(client.published, list(client.stats_history)))

    @router.post("/writer_mark")
    async def writer_mark() -> Response:
        return await _command(holder.current(), WRITER_MARK)

    @router.get("/requests")
    async def requests() -> Response:
        return await _command(holder.current(), "requests")

    @router.get("/requests/{request_id}")
    async def get(request_id: str) -> Response:
        return await _command(holder.current(), "get", request_id)

    @router.post("/submit")
    async def submit(request: Request) -> Response:
        command = await _decoded(request, SubmitCommand)
        return await _command(holder.current(), "submit", command.prompt_token_ids, command.sampling,
                              request_id=command.request_id, retain=command.retain, salt=command.salt)  # fmt: skip

    @router.post("/fork")
    async def fork(request: Request) -> Response:
        command = await _decoded(request, ForkCommand)
        return await _command(holder.current(), "fork_many", command.parent_id, command.suffixes, command.sampling,
                              request_ids=command.request_ids, retain=command.retain)  # fmt: skip

    @router.post("/release/{request_id}")
    async def release(request_id: str) -> Response:
        return await _command(holder.current(), "release", request_id)

    @router.post("/check")
    async def check() -> Response:
        return await _command(holder.current(), "check_invariants")

    @router.post("/reset")
    async def reset() -> Response:
        return await _command(holder.current(), "reset_cache")

    @router.post("/restart")
    async def restart(request: Request) -> Response:
        config = await _decoded(request, EngineConfig)
        try:
            client = await asyncio.to_thread(holder.restart, config)
        except EngineGone as exc:
            return _refused("EngineGone", str(exc))
        return _answer({"info": client.info, "boot_id": client.boot_id})

    return router
