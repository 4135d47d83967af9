"""The timed mode's service model, measured on the engine: prefill and decode tokens per second.

  prefill: one request of PREFILL_TOKENS distinct tokens and one new token, on an empty cache: the
           forward over the whole prompt (the engine's step, in one chunk), REPEATS times, median.
  decode:  DECODE_BATCH requests of 32-token prompts decoding together: the generated tokens of the
           steps after their prefill, over those steps' time (every request decodes one token a step).

These are the defaults of `analysis.timed.ServiceModel` (SmolLM2-135M-Instruct, fp32, CPU). The machine
is shared with other work (2 cores); under load, torch's two threads contend with the other processes
and one thread (OMP_NUM_THREADS=1) measured faster. Run it on an idle machine for the numbers to use.

Run: `.venv/bin/python benchmarks/service_rates.py [--model smollm2] [--data-dir DIR]`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402

PREFILL_TOKENS = 1024
REPEATS = 3
DECODE_BATCH = 8
DECODE_STEPS = 32


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def prefill_rate(engine: Engine) -> float:
    times = []
    for repeat in range(REPEATS):
        engine.submit(prompt(PREFILL_TOKENS, repeat, engine.vocab_size), SamplingParams(max_new_tokens=1))
        started = time.perf_counter()
        engine.run_until_idle()
        times.append(time.perf_counter() - started)
    return PREFILL_TOKENS / statistics.median(times)


def decode_rate(engine: Engine) -> float:
    params = SamplingParams(max_new_tokens=DECODE_STEPS + 1, ignore_eos=True)
    for index in range(DECODE_BATCH):
        engine.submit(prompt(32, 100 + index, engine.vocab_size), params)
    engine.step()  # every prompt in one chunk: the prefill step
    started = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = time.perf_counter() - started
    engine.run_until_idle()
    return DECODE_BATCH * DECODE_STEPS / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device="cpu", num_blocks=512, data_dir=args.data_dir)
    engine = Engine(config)
    print(f"service rates of {engine.loaded.model_id} ({config.dtype}, {engine.loaded.device}); shared machine")
    print(f"  prefill: {prefill_rate(engine):8.0f} tokens/s  ({PREFILL_TOKENS}-token prompt, median of {REPEATS})")
    print(f"  decode:  {decode_rate(engine):8.1f} tokens/s  ({DECODE_BATCH} requests decoding together)")


if __name__ == "__main__":
    main()
