"""The prompt keys of finished requests (revision 0004): stored by both writers on both backends, read
back for the workload analyzer, and added to older databases without touching their rows."""

from __future__ import annotations

from sqlalchemy import JSON, insert
from sqlalchemy import column as sql_column
from sqlalchemy import table as sql_table

from storage import migrate
from storage.read import queries
from tests.storage_support import BASE_TIME, LATEST_REVISION, RUN_INFO, request_view

KEYS = bytes(range(32))  # two 16-byte keys
CONTENT = bytes(range(100, 132))


def test_a_finished_requests_prompt_keys_are_stored_and_read_back(db_url: str, make_writer, engine_for) -> None:
    writer = make_writer(db_url)
    run_id = writer.start_run(RUN_INFO)
    running = request_view("a", status="running", prompt_token_ids=list(range(40)))
    writer.record_requests([running, request_view("b", status="running", prompt_token_ids=[1, 2])])
    assert writer.flush(timeout_s=10)
    finished = running._replace(status="finished", output_token_ids=(5, 6, 7), block_keys=KEYS, content_keys=CONTENT)
    writer.record_requests([finished])
    assert writer.flush(timeout_s=10)
    writer.record_requests([finished._replace(cached_tokens=16)])  # a later view keeps the keys
    assert writer.flush(timeout_s=10)

    chains = queries.prompt_chains(engine_for(db_url))
    assert chains["request_id"].tolist() == ["a"]  # b has not finished: no keys yet
    row = chains.iloc[0]
    assert bytes(row["block_keys"]) == KEYS and bytes(row["content_keys"]) == CONTENT
    assert (row["run_id"], row["prompt_tokens"], row["output_tokens"]) == (run_id, 40, 3)
    assert (row["block_size"], row["model"], row["dtype"]) == (RUN_INFO.block_size, RUN_INFO.model, RUN_INFO.dtype)
    assert queries.prompt_chains(engine_for(db_url), run_ids=["another run"]).empty


def test_revision_0004_adds_empty_key_columns_to_a_database_with_requests(db_url: str, engine_for) -> None:
    engine = engine_for(db_url)
    migrate.upgrade(engine, "0003")
    runs = sql_table("runs", *map(sql_column, ("id", "model", "num_blocks", "block_size", "dtype", "device", "started_at")))
    columns = ("run_id", "request_id", "status", "prompt_tokens", "cached_tokens", "computed_tokens", "hit_source",
               "cow_copies", "preemptions", "arrival_time")  # fmt: skip
    requests = sql_table("requests", *map(sql_column, columns), sql_column("output_token_ids", JSON))
    with engine.begin() as connection:
        connection.execute(
            insert(runs),
            [{"id": "old", "model": "m", "num_blocks": 4, "block_size": 16, "dtype": "float32", "device": "cpu",
              "started_at": BASE_TIME}],
        )  # fmt: skip
        connection.execute(
            insert(requests),
            [{"run_id": "old", "request_id": "r", "status": "finished", "prompt_tokens": 40, "cached_tokens": 0,
              "computed_tokens": 40, "hit_source": "none", "cow_copies": 0, "preemptions": 0,
              "arrival_time": BASE_TIME, "output_token_ids": [1]}],
        )  # fmt: skip

    migrate.upgrade(engine)

    assert migrate.current_revision(engine) == LATEST_REVISION
    row = queries.recent_requests(engine, "old").iloc[0]
    assert row["prompt_tokens"] == 40 and row["block_keys"] is None and row["content_keys"] is None
    assert queries.prompt_chains(engine).empty  # rows from before the revision have no keys to analyse
