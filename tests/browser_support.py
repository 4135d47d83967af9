"""The real-browser test's console server (registered from tests/conftest.py; no tests here).

`console_server` runs an engine server (`python -m cli serve`: the engine in its own process) on the
tiny-chat model with a temporary SQLite history, and `streamlit run app` attached to it, each on a free
loopback port, as `make run` does. Without chromium it skips locally and fails when CI=true.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts"
TIMEOUT_MS = 60_000  # every wait of a browser test's page
CHROMIUM = os.environ.get("PREFIX_CONSOLE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TEST_DATA_DIR = Path(os.environ.get("PREFIX_CONSOLE_TEST_DATA_DIR", ROOT / "data" / "test-cache"))
START_TIMEOUT_S = 60


def launch_page(playwright, expect, height: int = 1000):
    """Debian's chromium, headless, and one page of 1400 x `height` pixels; every wait of the page and of
    Playwright's `expect` is bounded by TIMEOUT_MS. Returns (browser, page): close the browser."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": height})
    page.set_default_timeout(TIMEOUT_MS)
    expect.set_options(timeout=TIMEOUT_MS)
    return browser, page


def require_chromium() -> None:
    if Path(CHROMIUM).is_file() or shutil.which(CHROMIUM):
        return
    message = f"chromium not found at {CHROMIUM} (apt-get install chromium, or `make system-deps`)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


@dataclass(frozen=True)
class ConsoleServer:
    """A running `streamlit run app`, attached to a running engine server."""

    url: str  # http://127.0.0.1:PORT
    pid: int  # its process
    engine_url: str  # the engine server's http://127.0.0.1:PORT (its API under /v1)
    engine_pid: int  # the engine server's process


def _wait_until_answers(url: str, process: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} did not start; see {log}")
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def engine_server(
    db_path: Path, num_blocks: int = 24, attention: str | None = None, log_name: str = "engine-server.log",
    serve_args: tuple[str, ...] = (),
) -> Iterator[tuple[str, int]]:
    """`python -m cli serve` on tiny-chat (its attention overridden when `attention` says, e.g. "hybrid:64"),
    a free loopback port and the SQLite history at `db_path`, with `serve_args` added (e.g. a disk tier's
    "--offload-dir", DIR, "--offload-gib", G); yields (url, pid) once it answers."""
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    env = {**os.environ, "PREFIX_CONSOLE_DATA_DIR": str(TEST_DATA_DIR), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "cli", "serve", "--model", "tiny-chat", "--device", "cpu", "--block-size", "16",
               "--num-blocks", str(num_blocks), "--port", str(port), "--db", f"sqlite:///{db_path}"]  # fmt: skip
    if attention is not None:
        command += ["--attention", attention]
    command += serve_args
    with open(ARTIFACTS / log_name, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_answers(f"{url}/v1/models", process, ARTIFACTS / log_name, "the engine server")
            yield url, process.pid
        finally:
            _stop(process)


def open_connections(server: ConsoleServer) -> int:
    """Established TCP connections to the server's port that its process holds now (Linux: /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{server.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{server.pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    port = f"{int(server.url.rsplit(':', 1)[1]):04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()  # sl, local address:port, remote address:port, state, ..., inode at 9
            if fields[1].endswith(f":{port}") and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


@pytest.fixture
def console_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ConsoleServer]:
    """`streamlit run app` on a free loopback port: a pool of 24 blocks of 16, or as many blocks as an
    indirect parameter says."""
    with serve_console(tmp_path, num_blocks=getattr(request, "param", 24)) as server:
        yield server


@contextlib.contextmanager
def serve_console(
    tmp_path: Path, extra_env: dict[str, str] | None = None, num_blocks: int = 24, attention: str | None = None,
    serve_args: tuple[str, ...] = (),
) -> Iterator[ConsoleServer]:
    """An engine server with a pool of `num_blocks` blocks of 16 (and `serve_args`) and `streamlit run app`
    attached to it, on free loopback ports, with `extra_env` added to the console's environment; yields the
    console server."""
    require_chromium()
    with engine_server(tmp_path / "history.sqlite", num_blocks, attention, serve_args=serve_args) as (engine_url, engine_pid):
        with _console(tmp_path, engine_url, extra_env) as (url, pid):
            yield ConsoleServer(url, pid, engine_url, engine_pid)


@contextlib.contextmanager
def _console(tmp_path: Path, engine_url: str, extra_env: dict[str, str] | None) -> Iterator[tuple[str, int]]:
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "PREFIX_CONSOLE_ENGINE": engine_url,
        "PREFIX_CONSOLE_DB_URL": f"sqlite:///{tmp_path / 'history.sqlite'}",
        "PREFIX_CONSOLE_DATA_DIR": str(TEST_DATA_DIR),
        "HF_HUB_OFFLINE": "1",
        **(extra_env or {}),
    }
    log = open(ARTIFACTS / "browser-server.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app", "--server.port", str(port), "--server.address", "127.0.0.1"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_answers(f"{url}/_stcore/health", process, ARTIFACTS / "browser-server.log", "streamlit")
        yield url, process.pid
    finally:
        _stop(process)
        log.close()
