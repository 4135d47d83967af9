"""The run-trace CLI: one JSON line per finished request, a summary line, clear errors naming the line.

`python -m cli run-trace` is the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.__main__ import main

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def write_trace(tmp_path: Path, lines: list[dict | str]) -> Path:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return trace


def run_trace(tmp_path: Path, lines: list[dict | str], *extra: str, capsys=None) -> Result:
    """Run the CLI in-process (the model import is paid once per test session)."""
    trace = write_trace(tmp_path, lines)
    code = main(["run-trace", str(trace), "--model", "tiny-llama", "--device", "cpu", "--block-size", "4", *extra])
    out, err = capsys.readouterr()
    return Result(code, out, err)


def records(proc: Result) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_trace_with_retain_fork_release_and_prefix_hit(tmp_path, capsys):
    prefix = list(range(10, 30))
    proc = run_trace(
        tmp_path,
        [
            {"op": "submit", "id": "a", "tokens": prefix + [5], "max_new_tokens": 3, "retain": True, "ignore_eos": True},
            {"op": "run"},
            {"op": "fork", "id": "b", "parent": "a", "suffix_tokens": [7, 8, 9], "max_new_tokens": 2, "ignore_eos": True},
            {"op": "fork", "id": "c", "parent": "a", "suffix_tokens": [9], "max_new_tokens": 2, "ignore_eos": True},
            {"op": "run"},
            {"op": "release", "id": "a"},
            {"op": "submit", "id": "d", "tokens": prefix + [40, 41], "max_new_tokens": 2, "ignore_eos": True},
            {"op": "run"},
        ],
        "--num-blocks", "64",
        capsys=capsys,
    )
    assert proc.returncode == 0, proc.stderr
    out = {r.get("id"): r for r in records(proc) if "id" in r}
    summary = records(proc)[-1]["summary"]
    assert out["a"]["prompt_tokens"] == 21 and out["a"]["hit_source"] == "none"
    assert out["b"]["parent"] == "a" and out["b"]["hit_source"] == "fork"
    # a computed 21 prompt + 2 fed-back tokens: 5 full blocks and a 3-token tail both children share.
    assert out["b"]["cached_tokens"] == 23 and out["b"]["computed_tokens"] == 1 + 3
    assert out["b"]["cow_copies"] == 1 and out["c"]["cow_copies"] == 1
    assert out["b"]["block_table"][:5] == out["c"]["block_table"][:5]
    assert out["d"]["hit_source"] == "prefix" and out["d"]["cached_tokens"] == 20
    assert len(out["d"]["output_token_ids"]) == 2
    assert summary["invariants_ok"] is True
    assert summary["cow_copies"] == 2 and summary["used_blocks"] == 0


def test_rejected_request_is_reported_and_replay_goes_on(tmp_path, capsys):
    proc = run_trace(
        tmp_path,
        [
            {"op": "submit", "id": "big", "tokens": list(range(3, 60)), "max_new_tokens": 4},
            {"op": "submit", "id": "ok", "tokens": [3, 4, 5], "max_new_tokens": 2},
        ],
        "--num-blocks", "8",
        capsys=capsys,
    )
    assert proc.returncode == 0, proc.stderr
    recs = records(proc)
    assert recs[0]["id"] == "big" and "pool" in recs[0]["rejected"]
    assert recs[1]["id"] == "ok" and len(recs[1]["output_token_ids"]) >= 1
    assert recs[-1]["summary"]["invariants_ok"] is True


def test_bad_lines_name_the_line_and_keep_state_consistent(tmp_path, capsys):
    cases = [
        ({"op": "explode"}, "unknown op"),
        ({"op": "fork", "id": "x", "parent": "ghost", "suffix_tokens": [1]}, "unknown parent"),
        ({"op": "submit", "id": "e", "tokens": []}, "empty"),
        ({"op": "submit", "id": "long", "tokens": [5] * 2100}, "positions"),
        ("{not json", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),  # nested too deeply (it was a RecursionError traceback)
        ({"op": "submit", "id": "s", "tokens": [3, 4], "salt": {"tenant": 1}}, "salt must be None or a string"),
    ]
    for bad, message in cases:
        proc = run_trace(tmp_path, [{"op": "submit", "id": "a", "tokens": [3, 4, 5], "max_new_tokens": 2}, bad],
                         "--num-blocks", "32", capsys=capsys)
        assert proc.returncode == 2
        assert "line 2" in proc.stderr and message in proc.stderr, proc.stderr
        assert records(proc)[-1]["summary"]["invariants_ok"] is True


def test_cli_runs_as_a_module(tmp_path):
    trace = write_trace(tmp_path, [{"op": "submit", "id": "a", "tokens": [3, 4, 5], "max_new_tokens": 2}])
    cmd = [sys.executable, "-m", "cli", "run-trace", str(trace), "--model", "tiny-llama", "--device", "cpu"]
    env = {"PREFIX_CONSOLE_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines[0]["id"] == "a" and lines[-1]["summary"]["invariants_ok"] is True


# Runs `python -m cli ARGS...` in this interpreter, then reports which storage modules it imported.
IMPORTED_STORAGE = """
import runpy, sys
sys.argv = ["cli", *sys.argv[1:]]
try:
    runpy.run_module("cli", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status, "storage": sorted(m for m in sys.modules if m.split(".")[0] == "storage")}))
"""


def imported_storage(tmp_path: Path, *extra: str) -> dict:
    trace = write_trace(tmp_path, [{"op": "submit", "id": "a", "tokens": [3, 4, 5], "max_new_tokens": 2}])
    args = ["run-trace", str(trace), "--model", "tiny-llama", "--device", "cpu", *extra]
    code = "import json\n" + IMPORTED_STORAGE
    env = {**os.environ, "PREFIX_CONSOLE_DATA_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_run_trace_imports_storage_only_for_db(tmp_path):
    without_db = imported_storage(tmp_path)
    assert without_db == {"status": 0, "storage": []}
    with_db = imported_storage(tmp_path, "--db", f"sqlite:///{tmp_path / 'history.sqlite'}")
    assert with_db["status"] == 0 and "storage.write.writer_process" in with_db["storage"]


def test_the_dispatcher_imports_no_torch_and_no_storage():
    """Commands that never run the engine (the analyzer and fleet commands to come) must not pay for torch."""
    code = "import sys, cli.__main__; print(sorted({'torch', 'storage', 'engine.engine'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_bad_option_or_a_missing_trace_is_a_clear_error(tmp_path, capsys):
    assert main(["run-trace", str(tmp_path / "none.jsonl"), "--block-size", "0"]) == 2
    assert "block_size" in capsys.readouterr().err
    assert main(["run-trace", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read the trace" in capsys.readouterr().err


def test_a_line_that_is_not_utf8_is_named_and_nothing_is_applied(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(json.dumps({"op": "submit", "id": "a", "tokens": [3, 4, 5], "max_new_tokens": 2}).encode()
                      + b"\n\xff\xfe\n")  # fmt: skip
    code = main(["run-trace", str(trace), "--model", "tiny-llama", "--device", "cpu", "--num-blocks", "32"])
    out, err = capsys.readouterr()
    assert code == 2 and "line 2: not valid JSON" in err and "Traceback" not in err
    assert json.loads(out.splitlines()[-1])["summary"]["invariants_ok"] is True


def test_a_bad_database_url_is_refused_before_the_model_loads(tmp_path, capsys):
    trace = write_trace(tmp_path, [{"op": "run"}])
    for url in ("not a url", "foo://bar"):
        assert main(["run-trace", str(trace), "--model", "no-such-model", "--db", url]) == 2
        assert capsys.readouterr().err.startswith("error: cannot use the database URL")


def test_a_replay_that_crashes_still_writes_the_history_it_made(tmp_path, capsys, monkeypatch):
    """The writer is closed on every way out, so rows handed over before an unexpected error are kept."""
    import cli.trace
    from sqlalchemy import func, select

    from storage.db import db_engine
    from storage.schema import RequestRecord

    def apply_or_crash(engine, op, emit):
        if op["op"] == "reset":
            raise RuntimeError("a bug in the middle of a replay")
        applying(engine, op, emit)

    applying = cli.trace._apply
    monkeypatch.setattr(cli.trace, "_apply", apply_or_crash)
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    lines = [{"op": "submit", "id": "a", "tokens": [3, 4, 5], "max_new_tokens": 2}, {"op": "run"}, {"op": "reset"}]
    with pytest.raises(RuntimeError, match="a bug in the middle"):
        run_trace(tmp_path, lines, "--num-blocks", "32", "--db", url, capsys=capsys)
    db = db_engine(url)
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(RequestRecord)).scalar() == 1
    db.dispose()


def test_db_flag_persists_requests_events_and_evictions(tmp_path, capsys):
    from sqlalchemy import func, select

    from storage.db import db_engine
    from storage.schema import Eviction, RequestRecord, Run

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    lines = [{"op": "submit", "id": f"r{i}", "tokens": list(range(10 + 20 * i, 30 + 20 * i)), "max_new_tokens": 2}
             for i in range(4)]
    proc = run_trace(tmp_path, lines + [{"op": "run"}], "--num-blocks", "12", "--db", url, capsys=capsys)
    assert proc.returncode == 0, proc.stderr
    summary = records(proc)[-1]["summary"]
    db = db_engine(url)
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Run)).scalar() == 1
        assert conn.execute(select(func.count()).select_from(RequestRecord)).scalar() == 4
        assert conn.execute(select(func.count()).select_from(Eviction)).scalar() == summary["evictions"] > 0


def test_db_of_a_newer_schema_is_left_untouched_and_the_lost_rows_are_an_error(tmp_path, capsys):
    from sqlalchemy import text

    from storage import migrate
    from storage.db import db_engine

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    migrate.upgrade(url)
    db = db_engine(url)
    with db.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    lines = [{"op": "submit", "id": "a", "tokens": [3, 4, 5], "max_new_tokens": 2}, {"op": "run"}]
    proc = run_trace(tmp_path, lines, "--num-blocks", "32", "--db", url, capsys=capsys)
    assert proc.returncode == 1
    assert records(proc)[-1]["summary"]["invariants_ok"] is True  # the replay itself ran to its end
    assert "could not be written" in proc.stderr and "SchemaTooNewError" in proc.stderr and "9999" in proc.stderr
    assert migrate.current_revision(db) == "9999"
    db.dispose()


def test_db_rows_carry_the_sliding_window_replay_fields(tmp_path, capsys):
    from sqlalchemy import select

    from storage.db import db_engine
    from storage.schema import RequestRecord

    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    prefix = list(range(10, 50))
    lines = [
        {"op": "submit", "id": "a", "tokens": prefix, "max_new_tokens": 1},
        {"op": "run"},
        {"op": "submit", "id": "b", "tokens": prefix[:36] + [7, 8, 9], "max_new_tokens": 1},
    ]
    proc = run_trace(tmp_path, lines, "--num-blocks", "64", "--attention-override", "hybrid:8", "--db", url,
                     capsys=capsys)
    assert proc.returncode == 0, proc.stderr
    out = {r["id"]: r for r in records(proc) if "id" in r}
    assert (out["b"]["h"], out["b"]["r"], out["b"]["replay_mode"]) == (36, 0, "exact")
    with db_engine(url).connect() as conn:
        row = conn.execute(select(RequestRecord).where(RequestRecord.request_id == "b")).mappings().one()
    assert (row["h"], row["r"], row["replay_mode"], row["replayed_tokens"]) == (36, 0, "exact", 36)


def test_the_eviction_policy_is_chosen_on_the_command_line(tmp_path, capsys):
    """A prefix reused once survives three single-use requests in a 6-block pool under reuse-LRU, not LRU."""
    prefix = list(range(10, 18))
    lines = [{"op": "submit", "id": f"p{i}", "tokens": prefix + [i], "max_new_tokens": 1} for i in (1, 2)]
    lines += [{"op": "submit", "id": f"q{i}", "tokens": list(range(20 * i, 20 * i + 8)) + [i], "max_new_tokens": 1}
              for i in (3, 4, 5)]  # fmt: skip
    lines += [{"op": "submit", "id": "again", "tokens": prefix + [6], "max_new_tokens": 1}]
    ops = [op for line in lines for op in (line, {"op": "run"})]
    hits = {}
    for policy in ("lru", "reuse-lru"):
        proc = run_trace(tmp_path, ops, "--num-blocks", "6", "--eviction-policy", policy, capsys=capsys)
        assert proc.returncode == 0, proc.stderr
        hits[policy] = {r["id"]: r["cached_tokens"] for r in records(proc) if "id" in r}
    assert hits["lru"]["p2"] == hits["reuse-lru"]["p2"] == 8
    assert (hits["lru"]["again"], hits["reuse-lru"]["again"]) == (0, 8)
