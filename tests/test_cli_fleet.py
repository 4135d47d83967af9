"""`python -m cli fleet watch | state`: the headless collector into the history, and what it stored.

The watch runs as the operator runs it (a subprocess, stopped by a signal) against vLLM's own
KVCacheManager published by vLLM's own ZmqEventPublisher; `state` then reads the database in-process.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli.__main__ import main
from cli.fleet import STOP_TIMEOUT_S, WATCH_GC_THRESHOLDS
from storage.db import db_engine
from tests.fleet_history_support import held_copies
from tests.fleet_support import HandFeed, encode_batch, stored_map
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        ("pod-a", "expected NAME=tcp://HOST:PORT"),
        ("pod-a=http://10.0.0.5:5557", "endpoint 'http://10.0.0.5:5557'"),
        ("pod-a=tcp://10.0.0.5:5557,replay", "unknown option 'replay'"),
        ("pod-a=tcp://10.0.0.5:5557,color=red", "unknown option 'color=red'"),
        ("pod-a=tcp://10.0.0.5:5557,metrics=ftp://x", "metrics_url 'ftp://x'"),
        ("pod a=tcp://10.0.0.5:5557", "pod name 'pod a'"),
        ("pod-a=tcp://10.0.0.5:", "a port in 1-65535"),  # ZeroMQ's connect raises
        ("pod-a=tcp://10.0.0.5:70000", "a port in 1-65535"),  # ZeroMQ's connect takes it
        ("pod-a=tcp://:5557", "with a host"),
        ("pod-a=ipc://", "an empty address"),
        (f"pod-a=ipc:///tmp/{'x' * 120}", "at most 107 bytes"),
    ],
)
def test_a_malformed_pod_is_refused_with_exit_status_2(capsys, tmp_path: Path, pod: str, says: str) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["fleet", "watch", "--pod", pod, "--db", f"sqlite:///{tmp_path / 'h.sqlite'}"])
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "h.sqlite").exists()


def test_two_pods_of_one_name_are_refused(capsys, tmp_path: Path) -> None:
    pod = "a=tcp://127.0.0.1:5557"
    code, _, err = run_cli(capsys, "fleet", "watch", "--pod", pod, "--pod", pod, "--db", f"sqlite:///{tmp_path / 'h'}")
    assert code == 2 and "unique" in err


def test_state_refuses_a_database_that_is_not_there_and_a_pod_it_never_saw(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "fleet", "state", "--db", f"sqlite:///{tmp_path / 'missing.sqlite'}")
    assert code == 2 and "no database file" in err
    assert not (tmp_path / "missing.sqlite").exists()


@pytest.mark.parametrize(
    "argv",
    [["fleet", "watch", "--pod", "a=tcp://127.0.0.1:9", "--db", "foo://x"], ["fleet", "state", "--db", "not a url"]],
)
def test_a_database_url_that_cannot_be_used_is_refused_with_exit_status_2(capsys, argv: list[str]) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and err.startswith("error: cannot use the database URL") and "Traceback" not in err


def watch(url: str, *pods: str) -> subprocess.Popen:
    """`python -m cli fleet watch` as an operator starts it, with a status line every 0.2 s."""
    argv = [sys.executable, "-m", "cli", "fleet", "watch", "--db", url, "--status-every", "0.2"]
    for pod in pods:
        argv += ["--pod", pod]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=environment)


def stop(process: subprocess.Popen, sig: int) -> tuple[int, str]:
    process.send_signal(sig)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return process.returncode, err


def test_watch_stores_vllms_feed_until_a_signal_and_state_prints_what_it_holds(capsys, db_url: str) -> None:
    pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")
    from tests.fleet_support import VllmPod, wait_until

    pod = VllmPod(num_blocks=16, block_size=4)
    process = watch(db_url, f"{pod.name}={pod.endpoint},replay=tcp://127.0.0.1:{pod.replay_port},topic=kv-events")
    engine = db_engine(db_url)
    try:
        a = pod.request(list(range(14)))
        pod.allocate(a)
        pod.publish()  # seq 0: the watcher recovers it by replay if it subscribed after it was sent
        c, d = pod.request(list(range(200, 209))), pod.request(list(range(200, 209)))
        lookups = pod.lookup(c), pod.lookup(d)
        pod.allocate(c, lookups[0])
        pod.allocate(d, lookups[1])
        pod.free(a)
        pod.publish()

        def stored() -> dict:
            try:
                state = main(["fleet", "state", "--db", db_url, "--json"]) == 0 and json.loads(capsys.readouterr().out)
            except (SystemExit, json.JSONDecodeError):
                return {}
            return state["pods"][0] if state and state["pods"] else {}

        wait_until(lambda: stored().get("num_blocks") == sum(pod.cached().values()), "the watcher's rows", 60)
        code, err = stop(process, signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
        pod.close()

    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("fleet watch: ")]
    assert len(lines) >= 3 and "pods 1/1 ready" in lines[-1] and "0 dropped" in lines[-1], err
    code, out, _ = run_cli(capsys, "fleet", "state", "--db", db_url, "--pod", pod.name, "--json", "--hashes")
    (state,) = json.loads(out)["pods"]
    assert code == 0 and state["closed_at"] is not None  # the signal closed the source
    cached = pod.cached()
    assert state["num_blocks"] == sum(cached.values()) and state["num_hashes"] == len(cached)
    assert sorted(map(int, state["hashes"])) == sorted(block_hash for _, _, block_hash in cached)
    assert held_copies(engine, state["source_id"]) == cached
    code, out, _ = run_cli(capsys, "fleet", "state", "--db", db_url)
    assert code == 0 and out.startswith(f"{pod.name}: {sum(cached.values())} blocks held ({len(cached)} hashes)")
    code, _, err = run_cli(capsys, "fleet", "state", "--db", db_url, "--pod", "nobody")
    assert code == 2 and "no pod named nobody" in err
    engine.dispose()


def test_watch_stops_cleanly_on_sigint_with_nothing_to_watch(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    process = watch(url, "quiet=tcp://127.0.0.1:9")  # nothing listens there: connecting forever
    try:
        for line in process.stderr:
            if line.startswith("fleet watch: ") and "ready" in line:
                break
        code, err = stop(process, signal.SIGINT)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 0, err
    assert "Traceback" not in err


def test_a_watch_on_a_database_that_takes_no_rows_still_stops_on_a_signal() -> None:
    """A database that is down refuses every row: the writer's queue fills, the storage sink waits on it,
    and the collector's queue fills behind. SIGTERM still ends the watch, within STOP_TIMEOUT_S for the
    sinks and again for the writer, exit 1, with what was queued counted as dropped."""
    pytest.importorskip("psycopg")
    down = f"postgresql+psycopg://prefix:console@127.0.0.1:{free_port()}/history"  # nothing listens there
    feed = HandFeed()
    process = watch(down, f"a=tcp://127.0.0.1:{feed.port}")
    try:
        feed.wait_for_subscriber()
        for seq in range(20_000):  # more than the writer's queue and the collector's together
            feed.send(seq, encode_batch([stored_map([seq + 1], [1] * 4)]))
            if seq % 1000 == 999:
                time.sleep(0.05)  # within the PUB socket's high-water mark
        for line in process.stderr:  # the dispatcher waits on the writer: "queued" stops growing
            if line.startswith("fleet watch: ") and "4,09" in line and "last db error" in line:
                break
        began = time.monotonic()
        code, err = stop(process, signal.SIGTERM)
        seconds = time.monotonic() - began
    finally:
        if process.poll() is None:
            process.kill()
        feed.close()
    assert code == 1, err
    assert seconds < 2 * STOP_TIMEOUT_S + 10, seconds
    assert "the database took no rows for 10 s" in err and "history rows could not be written" in err
    assert "Traceback" not in err


def test_a_watch_raises_the_garbage_collectors_thresholds_while_it_runs_and_restores_them(tmp_path: Path) -> None:
    before = gc.get_threshold()
    seen = []

    def look_then_interrupt() -> None:  # the thresholds change after the watch's signal handlers are in place
        deadline = time.monotonic() + 30
        while gc.get_threshold() == before and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(gc.get_threshold())
        os.kill(os.getpid(), signal.SIGINT)

    looker = threading.Thread(target=look_then_interrupt)
    looker.start()
    code = main(["fleet", "watch", "--pod", "quiet=tcp://127.0.0.1:9", "--db", f"sqlite:///{tmp_path / 'h.sqlite'}"])
    looker.join()
    assert code == 0
    assert seen == [WATCH_GC_THRESHOLDS]
    assert gc.get_threshold() == before


def state_of(capsys, db_url: str, *extra: str) -> dict:
    """The first pod of `fleet state --json` ({} while there is none, or the schema is not there yet)."""
    try:
        code = main(["fleet", "state", "--db", db_url, "--json", *extra])
    except SystemExit:
        return {}
    out = capsys.readouterr().out
    if code != 0:
        return {}
    pods = json.loads(out)["pods"]
    return pods[0] if pods else {}


def test_watch_scrapes_a_pods_metrics_url_into_the_history(capsys, db_url: str) -> None:
    """Bug 4 of issue 31: `metrics=URL` was accepted and never scraped."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")
    from storage.read import fleet_queries
    from tests.fleet_support import MetricsServer, VllmPod, vllm_metrics_text, wait_until

    pod = VllmPod()
    server = MetricsServer(vllm_metrics_text(queries=200, hits=150, scheduler=True))
    pods = f"{pod.name}={pod.endpoint},replay=tcp://127.0.0.1:{pod.replay_port},topic=kv-events,metrics={server.url}"
    process = watch(db_url, pods)
    engine = db_engine(db_url)
    try:
        wait_until(lambda: state_of(capsys, db_url).get("source_id") is not None, "the source row", 60)
        source_id = state_of(capsys, db_url)["source_id"]
        wait_until(lambda: len(fleet_queries.metrics_history(engine, [source_id])) > 0, "a scrape in the history", 60)
        code, err = stop(process, signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
        pod.close()
        server.close()
    assert code == 0, err
    scraped = fleet_queries.metrics_history(engine, [source_id]).iloc[-1]
    assert (scraped["prefix_cache_queries"], scraped["prefix_cache_hits"], scraped["kv_cache_usage"]) == (200, 150, 0.5)
    assert (scraped["num_running"], scraped["num_waiting"], scraped["num_gpu_blocks"]) == (3, 1, 2000)
    engine.dispose()


def test_state_tells_a_down_pod_and_a_killed_collector_from_a_watched_live_one(capsys, db_url: str) -> None:
    """Bug 5 of issue 31: with vLLM down, `state` printed "... blocks held ... watching", and a killed
    collector's source read "watching" for ever."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")
    from tests.fleet_support import VllmPod, wait_until

    pod = VllmPod()
    process = watch(db_url, f"{pod.name}={pod.endpoint},replay=tcp://127.0.0.1:{pod.replay_port},topic=kv-events")
    try:
        request = pod.request(list(range(9)))
        pod.allocate(request)
        pod.publish()
        wait_until(lambda: state_of(capsys, db_url).get("num_blocks") == 2, "the watcher's rows", 60)
        wait_until(lambda: state_of(capsys, db_url).get("health") == "live", "a live pod", 30)
        live = state_of(capsys, db_url)
        assert live["watching"] and not live["stale"] and live["link"] == "connected"
        assert (live["num_lost_batches"], live["num_restarts"]) == (0, 0)

        pod.close()  # the server goes down
        wait_until(lambda: state_of(capsys, db_url).get("stale") is True, "the down pod to be stale", 30)
        down = state_of(capsys, db_url)
        assert down["watching"] and down["health"] in ("down", "unreachable") and down["num_blocks"] == 2
        main(["fleet", "state", "--db", db_url])
        text = capsys.readouterr().out
        assert "STALE" in text and f"link {down['link']}" in text

        process.kill()  # SIGKILL: the collector cannot close its source
        process.wait(30)
        wait_until(
            lambda: state_of(capsys, db_url, "--collector-lost-after", "1").get("watching") is False,
            "the killed collector to be seen",
            30,
        )
        main(["fleet", "state", "--db", db_url, "--collector-lost-after", "1"])
        text = capsys.readouterr().out
        assert "its collector is silent since" in text and "watching" not in text and "STALE" in text
    finally:
        if process.poll() is None:
            process.kill()
        pod.close()
