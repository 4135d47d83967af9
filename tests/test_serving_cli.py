"""`python -m cli serve`: the API alone, on its own engine, writing the history `cli why` reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai

from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 120


def wait_until_serving(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"cli serve exited with {process.returncode}: {process.stderr.read()}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("cli serve did not start")


def test_cli_serve_answers_the_sdk_writes_the_history_and_stops_on_sigterm(tmp_path: Path, test_data_dir: Path) -> None:
    port = free_port()
    db = f"sqlite:///{tmp_path / 'history.sqlite'}"
    command = [sys.executable, "-m", "cli", "serve", "--model", "tiny-chat", "--device", "cpu", "--port", str(port),
               "--num-blocks", "64", "--block-size", "16", "--db", db]  # fmt: skip
    env = {**os.environ, "PREFIX_CONSOLE_DATA_DIR": str(test_data_dir)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(process, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        system = {"role": "system", "content": "You explain prefix caches in one sentence, naming the blocks used."}
        ids = [client.chat.completions.create(model="tiny-chat", max_tokens=2, temperature=0, user="carol",
                                              messages=[system, {"role": "user", "content": text}]).id
               for text in (f"{which} question: which blocks did the last request share, and which did it "
                            "compute itself?" for which in ("First", "Second"))]  # fmt: skip
        client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert f"serving tiny-chat on {url}/v1" in stderr
    why = subprocess.run([sys.executable, "-m", "cli", "why", "--db", db, "--request", ids[1], "--json"], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True)  # fmt: skip
    answer = json.loads(why.stdout)
    assert answer["request_id"] == ids[1] and ids[1].startswith("chatcmpl-carol-")
    assert answer["cause"] == "diverged" and answer["match"]["request_id"] == ids[0]
