"""`python -m cli block-history`: a block's life read back from a history another process wrote.

run-trace plays issue 15's exercise into a SQLite history (a retained parent of one full and one
half-full block, two forks appending different tokens, the parent's release); block-history then
reads the shared tail's life from that file, as an operator would after the console is gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cli.__main__ import main
from tests.test_cli import ROOT, records, write_trace

EXERCISE = [  # block size 4: the parent computes 5 prompt tokens + 1 fed back = one full block and a half
    {"op": "submit", "id": "p", "tokens": [10, 11, 12, 13, 14], "max_new_tokens": 2, "retain": True, "ignore_eos": True},
    {"op": "run"},
    {"op": "fork", "id": "a", "parent": "p", "suffix_tokens": [7], "max_new_tokens": 1, "ignore_eos": True},
    {"op": "fork", "id": "b", "parent": "p", "suffix_tokens": [8], "max_new_tokens": 1, "ignore_eos": True},
    {"op": "run"},
    {"op": "release", "id": "p"},
]


def recorded_exercise(tmp_path: Path, capsys) -> tuple[str, dict]:
    """The exercise's history file, and run-trace's record of the parent (its final block table)."""
    url = f"sqlite:///{tmp_path / 'history.sqlite'}"
    trace = write_trace(tmp_path, EXERCISE)
    code = main(["run-trace", str(trace), "--model", "tiny-llama", "--device", "cpu", "--block-size", "4",
                 "--num-blocks", "16", "--db", url])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    parent = next(r for r in records(type("R", (), {"stdout": out})) if r.get("id") == "p")
    return url, parent


def test_block_history_prints_the_shared_tails_counts_holders_and_when_it_is_safe_to_reuse(tmp_path, capsys):
    url, parent = recorded_exercise(tmp_path, capsys)
    full, tail = parent["block_table"]
    assert main(["block-history", "--db", url, "--block", str(tail), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["event"], r["request_id"], r["ref_count"], r["holders"]) for r in rows] == [
        ("allocate", "p", 1, ["p"]),
        ("fork", "a", 2, ["p", "a"]),
        ("fork", "b", 3, ["p", "a", "b"]),
        ("cow", "a", 2, ["p", "b"]),
        ("cow", "b", 1, ["p"]),
        ("release", "p", 0, []),
    ]
    assert rows[-1]["marker"] == "no holder left: safe to reuse" and rows[-1]["state"] == "free"
    assert rows[1]["step"] == rows[2]["step"] < rows[3]["step"] == rows[4]["step"] < rows[5]["step"] + 1

    assert main(["block-history", "--db", url, "--block", str(full)]) == 0
    table = capsys.readouterr().out
    assert f"block {full} (full group)" in table and "evictable from here on" in table


def test_block_history_refuses_an_unknown_run_and_an_empty_history(tmp_path, capsys):
    url, _ = recorded_exercise(tmp_path, capsys)
    assert main(["block-history", "--db", url, "--block", "0", "--run", "no-such-run"]) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().err
    empty = f"sqlite:///{tmp_path / 'empty.sqlite'}"
    from storage import migrate
    from storage.db import db_engine

    db = db_engine(empty)
    migrate.upgrade(db)
    db.dispose()
    assert main(["block-history", "--db", empty, "--block", "0"]) == 2
    assert "holds no runs" in capsys.readouterr().err


def test_block_history_refuses_a_bad_database_or_block_without_a_traceback_or_a_new_file(tmp_path, capsys):
    typo = tmp_path / "histroy.sqlite"
    assert main(["block-history", "--db", f"sqlite:///{typo}", "--block", "0"]) == 2
    assert capsys.readouterr().err.startswith(f"error: no database file {typo}")
    assert not typo.exists()  # reading created nothing
    assert main(["block-history", "--db", "not a url", "--block", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: cannot use the database URL given: ArgumentError")
    for block in ("-1", str(2**63)):  # 2**63 overflowed SQLite's INTEGER, a traceback
        assert main(["block-history", "--db", f"sqlite:///{typo}", "--block", block]) == 2
        assert "--block must be a block id in [0, 1048576)" in capsys.readouterr().err


def test_block_history_runs_as_a_module(tmp_path, capsys):
    url, parent = recorded_exercise(tmp_path, capsys)
    cmd = [sys.executable, "-m", "cli", "block-history", "--db", url, "--block", str(parent["block_table"][1]), "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["ref_count"] for line in proc.stdout.splitlines()] == [1, 2, 3, 2, 1, 0]
