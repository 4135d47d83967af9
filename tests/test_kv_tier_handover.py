"""One disk tier, one engine process at a time (issue 44): the tier's lock, and a restart handing the tier over.

Two engine processes writing one tier's files would overwrite each other's slots (checksums keep a wrong
block from being served, but the warm blocks are lost). The tier's directory is locked while an engine
process has it open; a console restarting its own engine on the same directory closes the old one's tier
first, so the new one starts warm, and starts the old configuration again when the new one cannot start.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.core.config import EngineConfig, shares_disk_tier
from engine.core.request import SamplingParams
from engine.engine import Engine
from engine.runner.kv_tier_files import TierMismatchError
from tests.engine_support import tokens
from tests.test_app_support import console_env, host, wait_idle  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=2, ignore_eos=True)


def config(tmp_path: Path, **overrides) -> EngineConfig:
    fields = dict(model="tiny-llama", device="cpu", block_size=4, num_blocks=12, data_dir=tmp_path,
                  offload_dir=tmp_path / "tier", offload_gib=0.001)  # fmt: skip
    fields.update(overrides)
    return EngineConfig(**fields)


def open_elsewhere(cfg: EngineConfig) -> subprocess.CompletedProcess:
    """Build an engine of `cfg` in another process; it prints the blocks its tier started with."""
    script = textwrap.dedent(f"""
        from pathlib import Path
        from engine.core.config import EngineConfig
        from engine.engine import Engine
        e = Engine(EngineConfig(model="tiny-llama", device="cpu", block_size={cfg.block_size},
                                num_blocks={cfg.num_blocks}, data_dir=Path({str(cfg.data_dir)!r}),
                                offload_dir=Path({str(cfg.offload_dir)!r}), offload_gib={cfg.offload_gib}))
        print("ready", e.stats().tier.ready_blocks)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def served(engine: Engine, seeds: tuple[int, ...]) -> None:
    for seed in seeds:
        engine.submit(tokens(30, seed), GREEDY)
        engine.run_until_idle()


def test_a_tier_open_in_one_process_is_refused_to_another_naming_it(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path))
    served(engine, (1,))
    other = open_elsewhere(config(tmp_path))
    assert other.returncode != 0
    assert f"open in another engine process (pid {os.getpid()})" in other.stderr
    engine.close()


def test_a_closed_engine_hands_its_tier_to_another_process_warm(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path))
    served(engine, (1, 2))
    engine.close()  # writes the pool's cached blocks back, then gives the lock up
    other = open_elsewhere(config(tmp_path))
    assert other.returncode == 0, other.stderr
    ready = int(other.stdout.split()[-1])
    assert ready > 0, "the other process starts with the blocks this one left"


def test_a_closed_tier_takes_no_more_transfers(tmp_path: Path) -> None:
    engine = Engine(config(tmp_path))
    served(engine, (1,))
    engine.close()
    engine.close()  # twice is fine
    with pytest.raises(RuntimeError, match="disk tier was closed"):
        served(engine, (2, 3))  # evicts blocks the tier does not hold: stores the closed tier cannot take


def test_only_the_same_directory_is_shared(tmp_path: Path) -> None:
    a = config(tmp_path)
    assert shares_disk_tier(a, dataclasses.replace(a, num_blocks=20))
    assert shares_disk_tier(a, dataclasses.replace(a, offload_dir=tmp_path / "x" / ".." / "tier"))
    assert not shares_disk_tier(a, dataclasses.replace(a, offload_dir=tmp_path / "other"))
    assert not shares_disk_tier(a, dataclasses.replace(a, offload_dir=None, offload_gib=None))


@pytest.fixture
def tiered_console(console_env, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("PREFIX_CONSOLE_OFFLOAD_DIR", str(tmp_path / "tier"))
    monkeypatch.setenv("PREFIX_CONSOLE_OFFLOAD_GIB", "0.001")
    console_env(num_blocks=8)


def run_console(seed: int) -> None:
    engine = host().console.engine
    engine.submit([(seed * 7919 + i * 31) % 900 + 10 for i in range(100)], GREEDY)
    wait_idle()


def test_a_console_restart_on_the_same_tier_hands_it_over_warm(tiered_console) -> None:
    run_console(1)
    run_console(2)
    old = host().console
    new = host().restart(dataclasses.replace(old.engine.config, num_blocks=12))
    assert old.engine._forward.tier.closed, "the old engine gave the tier up"
    assert new.engine.stats().tier.ready_blocks > 0, "the new engine starts with the old one's blocks"
    run_console(1)
    assert new.engine.stats().tier.loads > 0, "and serves from them"


def test_a_console_restart_that_fails_on_the_tier_starts_the_old_configuration_again(tiered_console) -> None:
    run_console(1)
    run_console(2)
    old_config = host().console.engine.config
    with pytest.raises(TierMismatchError):
        host().restart(dataclasses.replace(old_config, block_size=32))  # the tier holds blocks of 16
    again = host().console
    assert again.engine.config == old_config and again.engine.stats().tier.ready_blocks > 0
    run_console(1)
    assert again.engine.stats().tier.loads > 0, "the old configuration serves on, warm"


def test_an_engine_server_restart_on_the_same_tier_hands_it_over_warm(tmp_path: Path) -> None:
    """The engine process's restart (the console's Settings through an attached console): the old process
    stops first, so the new one can open the tier, and starts with the old one's blocks."""
    from tests.serving_support import serve, shut, wait_until_ended

    served = serve(tmp_path, num_blocks=8, offload_dir=tmp_path / "tier", offload_gib=0.001)
    try:
        for seed in (1, 2):
            rid = served.engine.submit([(seed * 7919 + i * 31) % 900 + 10 for i in range(100)], GREEDY)
            wait_until_ended(served.engine, rid)
        holder = served.server.holder
        new = holder.restart(dataclasses.replace(holder.current().config, num_blocks=12))
        assert new.config.num_blocks == 12 and holder.current() is new
        assert new.snapshot().stats.tier.ready_blocks > 0, "the new engine process starts warm"
    finally:
        shut(served)
