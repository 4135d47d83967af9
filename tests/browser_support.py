"""The real-browser test's console server (registered from tests/conftest.py; no tests here).

`console_server` runs `streamlit run app` on a free loopback port against the tiny-chat model and a
temporary SQLite history. Without chromium it skips locally and fails when CI=true.
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
    """A running `streamlit run app`."""

    url: str  # http://127.0.0.1:PORT
    pid: int  # its process


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
    tmp_path: Path, extra_env: dict[str, str] | None = None, num_blocks: int = 24
) -> Iterator[ConsoleServer]:
    """`streamlit run app` on a free loopback port, a pool of `num_blocks` blocks of 16, with `extra_env`
    added to its environment; yields the server."""
    require_chromium()
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "PREFIX_CONSOLE_MODEL": "tiny-chat",
        "PREFIX_CONSOLE_NUM_BLOCKS": str(num_blocks),
        "PREFIX_CONSOLE_BLOCK_SIZE": "16",
        "PREFIX_CONSOLE_DEVICE": "cpu",
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
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"streamlit did not start; see {ARTIFACTS / 'browser-server.log'}")
            time.sleep(0.2)
        yield ConsoleServer(url, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
