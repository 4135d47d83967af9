"""`python -m cli analyze`: the JSON the issue names, a table, and exit status 2 with a clear message (never a
traceback) for every kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli.__main__ import main
from cli.analyze import UsageError, parse_capacities
from tests.analysis_support import BAILIAN_SAMPLE, CONVERSATION_SAMPLE
from tests.own_workload_support import token_prompts, write_run_trace

ROOT = Path(__file__).resolve().parent.parent
ISSUE_KEYS = {"requests", "input_tokens", "block_size", "unique_blocks", "max_hit_ratio", "curve", "misses", "seconds"}
MOONCAKE_LINE = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}


def analyze(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["analyze", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def lines_file(tmp_path: Path, *lines: dict | str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_json_has_the_issues_keys_one_point_per_policy_and_capacity(capsys):
    code, out, err = analyze(capsys, CONVERSATION_SAMPLE, "--capacity-tokens", "100k,1M", "--policies",
                             "lru,reuse-lru,fifo,lfu,opt", "--json")  # fmt: skip
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert ISSUE_KEYS <= set(report)
    assert [(p["policy"], p["capacity_tokens"]) for p in report["curve"]] == [
        (policy, capacity) for policy in ("lru", "reuse-lru", "fifo", "lfu", "opt") for capacity in (100_000, 10**6)
    ]
    assert all({"policy", "capacity_tokens", "hit_ratio", "hit_tokens"} <= set(p) for p in report["curve"])
    opt, lru = report["curve"][8], report["curve"][0]
    assert lru["hit_ratio"] <= opt["hit_ratio"] <= report["max_hit_ratio"]


def test_without_json_it_prints_a_table(capsys):
    code, out, _ = analyze(capsys, BAILIAN_SAMPLE, "--capacity-tokens", "64,160")
    assert code == 0
    assert out.startswith("bailian trace, sequential mode: 8 requests")
    assert "lru" in out and "reuse-lru" in out and "opt" in out


def test_another_block_size_splits_a_hash_id_trace(capsys):
    code, out, _ = analyze(capsys, CONVERSATION_SAMPLE, "--block-size", "16", "--capacity-tokens", "1M",
                           "--policies", "lru", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["block_size"] == 16


def test_the_timed_mode_reports_queueing_and_peak_blocks(tmp_path, capsys):
    trace = lines_file(tmp_path, MOONCAKE_LINE, {**MOONCAKE_LINE, "timestamp": 100_000})  # ms: 100 s later
    code, out, _ = analyze(capsys, trace, "--mode", "timed", "--capacity-tokens", "5k", "--policies", "lru",
                           "--prefill-tokens-per-s", "1000", "--json")  # fmt: skip
    assert code == 0
    point = json.loads(out)["curve"][0]
    assert point["timed"]["queueing_s"]["max"] == 0.0 and point["timed"]["peak_blocks_in_use"] >= 1


def test_a_run_trace_file_is_keyed_under_the_models_namespace(tmp_path, capsys, test_data_dir, monkeypatch):
    monkeypatch.setenv("PREFIX_CONSOLE_DATA_DIR", str(test_data_dir))
    workload = write_run_trace(tmp_path, token_prompts(12))
    code, out, err = analyze(capsys, workload, "--format", "run-trace", "--model", "tiny-llama", "--block-size", "4",
                             "--capacity-tokens", "48", "--json")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert (report["format"], report["requests"], report["block_size"]) == ("run-trace", 12, 4)


def test_history_needs_a_database(tmp_path, capsys):
    code, _, err = analyze(capsys, tmp_path / "missing.sqlite", "--format", "history")
    assert code == 2 and "no history database at" in err
    missing_by_url = tmp_path / "not" / "there.sqlite"
    code, _, err = analyze(capsys, f"sqlite:///{missing_by_url}", "--format", "history")
    assert code == 2 and err.startswith(f"error: no database file {missing_by_url}")
    assert not (tmp_path / "not").exists()  # reading created nothing
    for url, error in [("foo://bar", "NoSuchModuleError"), ("not a url://x", "ArgumentError"),
                       ("mysql://u@localhost/db", "ModuleNotFoundError")]:  # fmt: skip
        code, _, err = analyze(capsys, url, "--format", "history")
        assert code == 2 and err.startswith("error: cannot use the database URL") and error in err, err
    not_a_history = tmp_path / "empty.sqlite"
    not_a_history.write_bytes(b"")
    code, _, err = analyze(capsys, not_a_history, "--format", "history")
    assert code == 2 and err.startswith("error: cannot read the history")


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([MOONCAKE_LINE, '{"timestamp": 1, "input_length"'], "error: line 2: not valid JSON"),
        ([MOONCAKE_LINE, {**MOONCAKE_LINE, "hash_ids": [1, 2, 3]}],
         "error: line 2: hash_ids has 3 ids, but input_length 1000 at 512 tokens per block needs ceil(1000 / 512) = 2"),
        ([], "error: the trace is empty"),
        (["", "  "], "error: the trace is empty"),
        ([{"timestamp": 0}], "error: line 1: cannot tell the trace format"),
        ([MOONCAKE_LINE, {**MOONCAKE_LINE, "output_length": 2**64 - 1}],
         "error: line 2: output_length must be in [0, 2**40], got 18446744073709551615"),
    ],
)  # fmt: skip
def test_bad_traces_exit_2_with_the_line_number(tmp_path, capsys, lines, message):
    code, out, err = analyze(capsys, lines_file(tmp_path, *lines))
    assert (code, out) == (2, "")
    assert err.strip().startswith(message) and "Traceback" not in err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--capacity-tokens", "lots"], "error: --capacity-tokens: 'lots' is not a number of tokens"),
        (["--policies", "lru,mru"], "error: --policies: 'lru,mru' names an unknown policy"),
        (["--mode", "timed", "--policies", "opt"], "error: the timed mode runs the engine's scheduler and pool"),
        (["--block-size", "100"], "error: block size 100 does not divide 512"),
        (["--runs", "x"], "error: --model is for run-trace files and --runs for the history"),
        (["--prefill-tokens-per-s", "-5"], "error: service rates must be in [0.001, 1e+12] tokens per second"),
        (["--decode-tokens-per-s", "0"], "error: service rates must be in [0.001, 1e+12] tokens per second"),
        (["--prefill-tokens-per-s", "1e-320"], "error: service rates must be in"),  # prefill seconds: infinite
        (["--capacity-tokens", "100k", "--cost-per-hour", "inf"], "error: cost_per_hour must be a number in [0, 1e+"),
        (["--capacity-tokens", "100k", "--cost-per-hour", "nan"], "error: cost_per_hour must be a number in"),
    ],
)  # fmt: skip
def test_bad_options_exit_2_with_a_clear_message(capsys, options, message):
    code, _, err = analyze(capsys, CONVERSATION_SAMPLE, *options)
    assert code == 2 and err.strip().startswith(message), err


def test_capacities_are_parsed_exactly():
    assert parse_capacities("4.1M, 2.01k,1e3,4096") == (4_100_000, 2_010, 1_000, 4_096)
    for entry in ("0.5", "1.0000001k", "nan", "inf", "-1", "2e12", ""):
        with pytest.raises(UsageError):
            parse_capacities(entry)


def test_a_capacity_far_beyond_the_trace_is_no_larger_than_it_needs(capsys):
    """Above the trace's unique blocks every cache hits the same; the pool is not built at the typed size
    (10^12 tokens would be 6 * 10^10 blocks)."""
    results = {}
    for capacity in ("320", "1000G"):  # 320 tokens: the sample's 20 unique blocks of 16
        code, out, err = analyze(capsys, BAILIAN_SAMPLE, "--capacity-tokens", capacity, "--json")
        assert code == 0, err
        results[capacity] = [(p["policy"], p["hit_tokens"]) for p in json.loads(out)["curve"]]
    assert results["320"] == results["1000G"]
    code, out, err = analyze(capsys, BAILIAN_SAMPLE, "--mode", "timed", "--capacity-tokens", "1000G", "--json")
    assert code == 0, err


def test_a_missing_file_and_an_unknown_format_exit_2(tmp_path, capsys):
    code, _, err = analyze(capsys, tmp_path / "nope.jsonl")
    assert code == 2 and err.startswith("error: cannot read")
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it before the command runs
        main(["analyze", str(CONVERSATION_SAMPLE), "--format", "csv"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'csv'" in capsys.readouterr().err


def test_the_commands_help_loads_no_torch():
    script = (
        "import sys\n"
        "from cli.__main__ import main\n"
        "try:\n    main(['analyze', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch loaded:', 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "--capacity-tokens" in result.stdout and "torch loaded: False" in result.stdout
