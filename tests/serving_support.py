"""Helpers the API tests share: an engine process on tiny-chat, the API on a free port in front of it, and
the engine seen through `RemoteEngine` (the console's client) for the tests' own checks."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from engine.core.config import EngineConfig
from engine.core.request import SamplingParams
from serving.api import ApiLimits
from serving.console_routes import EngineHolder
from serving.engine_client import EngineClient
from serving.remote_engine import RemoteEngine
from serving.server import ApiServer
from tests.ports import free_port

BLOCK_SIZE = 16
NUM_BLOCKS = 256
MODEL = "tiny-chat"
ENDED = ("finished", "retained", "released", "rejected", "failed", "aborted")


@dataclass
class Served:
    engine: RemoteEngine  # the engine process, through the console's routes
    server: ApiServer
    client: openai.OpenAI


def serve(
    data_dir: Path, limits: ApiLimits | None = None, *, num_blocks: int = NUM_BLOCKS, model: str = MODEL,
    db_url: str | None = None, **config_fields: object,
) -> Served:
    config = EngineConfig(model=model, device="cpu", block_size=BLOCK_SIZE, num_blocks=num_blocks, data_dir=data_dir,
                          **config_fields)  # type: ignore[arg-type]  # fmt: skip
    server = ApiServer(EngineHolder(EngineClient.start(config, db_url=db_url), db_url), port=free_port(),
                       limits=limits)  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    return Served(RemoteEngine(server.url), server, client)


def shut(served: Served) -> None:
    served.client.close()
    served.engine.close()
    served.server.close()
    served.server.holder.close()


def wait_until_ended(engine: RemoteEngine, request_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.get(request_id).status not in ENDED:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{request_id} still {engine.get(request_id).status}")
        time.sleep(0.01)


def python_api_tokens(engine: RemoteEngine, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy output of the same prompt through the engine's own commands (not the OpenAI API)."""
    request_id = engine.submit(prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    wait_until_ended(engine, request_id)
    return list(engine.get(request_id).output_token_ids)


def post_raw(server: ApiServer, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST a raw body; returns the status and the JSON answer."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def post_json(server: ApiServer, path: str, payload: object) -> tuple[int, dict]:
    return post_raw(server, path, json.dumps(payload).encode())


def no_block_referenced(engine: RemoteEngine) -> bool:
    return all(block.ref_count == 0 for block in engine.snapshot().blocks)
