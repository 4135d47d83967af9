"""The engine on a CUDA GPU in one command: reference checks, then a benchmark next to transformers.

`--dry-run` runs every code path on the CPU with tiny sizes (a few minutes on 2 cores), to prove the
script before device time is spent on it. Results go to DIR/cuda_check.json and DIR/cuda_check.txt,
DIR = --out, else $OUT, else artifacts/cuda-check; both are rewritten after every measurement, so a run
cut short still leaves what it measured.

    1. environment   versions, device, the attention kernels (and why) and linears the runner chose per dtype
    2. reference     tiny random models (Llama, Mistral with a window, Qwen2, Qwen3, Llama hybrid:5) in
                     fp32 and bf16, on the device: cold prompts, chunked prefill, forks decoding together
                     (cascade), a prefix hit, a mixed step, contexts beyond the window; each logit row
                     against transformers' own SDPA forward on the same device, and cascade against the
                     plain path; then the engine end to end (prefix hits, forks) against `generate`.
                     Tolerances: fp32 max |logit difference| <= 1e-4 and greedy tokens equal (as on the
                     CPU); bf16 <= 0.05 (rows of magnitude ~1; bf16 keeps 8 bits of mantissa) and greedy
                     tokens equal wherever the reference's top-2 margin exceeds 0.05 (a nearer tie may
                     flip either way).
    3. benchmark     a random-weight model of Llama-3.2-1B's shape (benchmarks/random_models.py) in bf16:
                     time to first token with a 4,096-token prefix cached, against the 32-token suffix
                     alone; decode throughput at 1, 8, 64 and 256 concurrent forks of the cached prefix
                     (each its own suffix, 64 new tokens); KV memory. Side by side on the same GPU:
                     transformers `generate` with a copied prefix cache (one batch of N), and
                     transformers continuous batching (`generate_batch`'s machinery) with block sharing.
                     The engine runs with cascade on and, for the larger N, off.

On the device machine (torch 2.11, transformers 5.17, Python 3.12, no network) the engine also needs
xxhash. Prepare its wheel here, then run one command there (`--wheels` unpacks wheels onto sys.path):

    .venv/bin/python benchmarks/cuda_check.py --fetch-wheels artifacts/gpu-wheels
    device: python benchmarks/cuda_check.py --wheels artifacts/gpu-wheels    (carry artifacts/gpu-wheels)

The full run is sized for an H200 in under 8 minutes (`--budget-s`, default 420 s: cells that would start
past it are skipped and marked so).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/prefix_reuse.py
XXHASH = "xxhash==4.1.0"  # requirements.txt's pin


def use_wheels(directory: Path) -> None:
    """Unpack every wheel in `directory` (once) and put it first on sys.path: no pip needed."""
    target = directory / "unpacked"
    for wheel in sorted(directory.glob("*.whl")):
        marker = target / f".{wheel.name}"
        if not marker.exists():
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
            marker.touch()
    sys.path.insert(0, str(target))


def fetch_wheels(directory: Path) -> int:
    """Download the wheels the device machine lacks (Python 3.12, manylinux x86_64) into `directory`."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
        "--platform", "manylinux_2_17_x86_64", "-d", str(directory), XXHASH,
    ]  # fmt: skip
    return subprocess.call(command)


# ---------------------------------------------------------------------------------------------- results
@dataclass
class Report:
    """Everything measured so far, written out after every addition."""

    out_dir: Path
    started: float = field(default_factory=time.perf_counter)
    data: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def add(self, section: str, key: str, value: object, line: str | None = None) -> None:
        self.data.setdefault(section, {})[key] = value
        if line is not None:
            self.lines.append(line)
            print(line, flush=True)
        self.write()

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)
        self.write()

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.data["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        for name, text in (("cuda_check.json", json.dumps(self.data, indent=2, default=str)), ("cuda_check.txt", "\n".join(self.lines) + "\n")):
            staging = self.out_dir / f".{name}"
            staging.write_text(text)
            staging.replace(self.out_dir / name)


@dataclass(frozen=True)
class Budget:
    """Wall-clock budget: a cell that would start after `limit_s` is skipped."""

    started: float
    limit_s: float

    def left(self) -> float:
        return self.limit_s - (time.perf_counter() - self.started)


def guarded(report: Report, section: str, key: str, fn: Callable[[], object]) -> object:
    """Run one measurement; an error is recorded (with its traceback) instead of ending the run."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - a device check reports every failure and goes on
        report.add(section, key, {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()},
                   f"  {key}: FAILED {type(error).__name__}: {str(error)[:300]}")
        return None


# ---------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    device: str  # "cuda" or, dry run, "cpu"
    dtypes: tuple[str, ...]  # reference checks
    shape: dict  # benchmark model shape (benchmarks/random_models.py)
    prefix_len: int  # cached prefix
    suffix_len: int  # each request's own prompt tokens
    new_tokens: int  # generated per request
    fork_counts: tuple[int, ...]
    cascade_off_counts: tuple[int, ...]  # fork counts also run with cascade off
    ttft_reps: int
    block_size: int = 16


def settings_for(dry_run: bool) -> Settings:
    from benchmarks.random_models import LLAMA_3_2_1B

    if dry_run:
        tiny = dict(LLAMA_3_2_1B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, vocab_size=1024, bos_token_id=1, eos_token_id=2)
        return Settings("cpu", ("float32", "bfloat16"), tiny, 128, 16, 6, (1, 2, 4, 8), (8,), 3)
    return Settings("cuda", ("float32", "bfloat16"), LLAMA_3_2_1B, 4096, 32, 64, (1, 8, 64, 256), (8, 64, 256), 5)


TOLERANCES = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- 1. environment
def environment(report: Report, s: Settings) -> None:
    import torch
    import transformers

    from engine.runner.attention_kernels import choose_kernels
    from engine.runner.packed_linear import linear_kernels

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": s.device,
        "device_name": torch.cuda.get_device_name() if s.device == "cuda" else platform.processor() or "cpu",
    }
    report.add("environment", "versions", info, f"environment: {info}")
    for dtype_name in s.dtypes:
        dtype = getattr(torch, dtype_name)
        choice = choose_kernels(torch.device(s.device), dtype, 32, 8, 64)
        value = {
            "unmasked": choice.unmasked.value,
            "masked": choice.masked.value,
            "decodes": None if choice.decodes is None else choice.decodes.value,
            "notes": list(choice.notes),
            "linears": linear_kernels(torch.device(s.device), dtype),
        }
        report.add("environment", f"kernels_{dtype_name}", value, f"  kernels for {dtype_name}: {value}")


# ---------------------------------------------------------------------------------------------- 2. reference
REFERENCE_MODELS = (("tiny-llama", None), ("tiny-mistral", None), ("tiny-qwen2", None), ("tiny-qwen3", None), ("tiny-llama", "hybrid:5"))
REF_BLOCK_SIZE = 4


class Sequences:
    """Block tables for scripted steps: fresh tables, and forks sharing a parent's full blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))[::-1]
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}

    def new(self, name: str) -> None:
        self.tokens[name], self.tables[name] = [], []

    def fork(self, name: str, parent: str, depth_blocks: int) -> None:
        self.tokens[name] = self.tokens[parent][: depth_blocks * REF_BLOCK_SIZE]
        self.tables[name] = self.tables[parent][:depth_blocks]

    def chunk(self, runner, name: str, new: list[int]):
        from engine.runner.model_runner import GroupSlots, SeqChunk

        start = len(self.tokens[name])
        self.tokens[name] = self.tokens[name] + new
        while len(self.tables[name]) * REF_BLOCK_SIZE < len(self.tokens[name]):
            self.tables[name].append(self.free.pop())
        return SeqChunk(new, start, tuple(GroupSlots(self.tables[name], 0, start) for _ in runner.groups))


def reference_script() -> list[list[tuple[str, str | None, int]]]:
    """Steps of (sequence, fork-from or None, new tokens); a fork shares its parent's full blocks."""
    return [
        [("a", None, 13), ("b", None, 5)],  # cold prompts
        [("b", None, 1), ("c", None, 23)],  # a decode next to a long prefill
        [("b", None, 10), ("c", None, 1)],  # chunked prefill continues
        [("f1", "c", 1), ("f2", "c", 1), ("f3", "c", 2), ("c", None, 1)],  # forks of c (cascade), c itself
        [("f1", None, 1), ("f2", None, 1), ("f3", None, 1), ("h", "c", 7)],  # forks decode; h hits c's prefix
        [("a", None, 18)],  # beyond the tiny windows (5, 8)
    ]


def check_reference(report: Report, s: Settings, data_dir: Path) -> None:
    import random

    import torch

    from engine.runner.attention_plan import ALWAYS_CASCADE, NO_CASCADE
    from engine.runner.model_runner import ModelRunner
    from engine.core.config import EngineConfig
    from engine.runner.model_loading import load_model

    for dtype in s.dtypes:
        tolerance = TOLERANCES[dtype]
        for name, override in REFERENCE_MODELS:
            label = f"{name}{'+' + override if override else ''} {dtype}"

            def one() -> dict:
                def load():
                    return load_model(EngineConfig(model=name, dtype=dtype, device=s.device, data_dir=data_dir, attention_override=override))

                runners = {"cascade": ModelRunner(load(), 96, REF_BLOCK_SIZE, cascade=ALWAYS_CASCADE),
                           "plain": ModelRunner(load(), 96, REF_BLOCK_SIZE, cascade=NO_CASCADE)}
                reference = load()
                rng = random.Random(0)
                sequences = {key: Sequences(96) for key in runners}
                worst, worst_plain, flips, ties, rows = 0.0, 0.0, 0, 0, 0
                for step in reference_script():
                    new_tokens = {seq: [rng.randrange(3, 500) for _ in range(n)] for seq, _, n in step}
                    logits = {}
                    for key, runner in runners.items():
                        seqs = sequences[key]
                        for seq, parent, _ in step:
                            if parent is not None:
                                seqs.fork(seq, parent, len(seqs.tokens[parent]) // REF_BLOCK_SIZE)
                            elif seq not in seqs.tokens:
                                seqs.new(seq)
                        logits[key] = runner.execute([seqs.chunk(runner, seq, new_tokens[seq]) for seq, _, _ in step])
                    worst_plain = max(worst_plain, (logits["cascade"] - logits["plain"]).abs().max().item())
                    with torch.inference_mode():
                        for (seq, _, _), row in zip(step, logits["cascade"]):
                            ids = torch.tensor([sequences["cascade"].tokens[seq]], device=s.device)
                            want = reference.model(input_ids=ids, use_cache=False).logits[0, -1].float()
                            worst = max(worst, (row - want).abs().max().item())
                            top2 = want.topk(2).values
                            rows += 1
                            if int(row.argmax()) != int(want.argmax()):
                                if (top2[0] - top2[1]).item() > tolerance:
                                    flips += 1
                                else:
                                    ties += 1
                passed = worst <= tolerance and worst_plain <= tolerance and flips == 0
                return {"max_abs_diff": worst, "max_abs_diff_cascade_vs_plain": worst_plain, "rows": rows,
                        "greedy_flips": flips, "near_tie_flips": ties, "tolerance": tolerance, "passed": passed}

            result = guarded(report, "reference", label, one)
            if result is not None:
                report.add("reference", label, result,
                           f"  {label:28s} {'pass' if result['passed'] else 'FAIL'}: max |diff| {result['max_abs_diff']:.2e} "
                           f"(cascade vs plain {result['max_abs_diff_cascade_vs_plain']:.2e}), {result['rows']} rows, "
                           f"greedy flips {result['greedy_flips']} (+{result['near_tie_flips']} near ties), tol {tolerance:g}")


def check_engine(report: Report, s: Settings, data_dir: Path) -> None:
    """The engine end to end (scheduler, prefix hits, forks, cascade) against `generate` on the same device."""
    import random

    import torch
    from transformers import GenerationConfig

    from engine.core.config import EngineConfig
    from engine.engine import Engine
    from engine.runner.model_loading import load_model
    from engine.core.request import SamplingParams

    def one() -> dict:
        config = EngineConfig(model="tiny-llama", dtype="float32", device=s.device, block_size=4, num_blocks=256, data_dir=data_dir)
        engine = Engine(config)
        reference = load_model(EngineConfig(model="tiny-llama", device=s.device, data_dir=data_dir))
        rng = random.Random(1)
        prefix = [rng.randrange(3, 500) for _ in range(37)]
        prompts = [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
        engine.submit(prefix, SamplingParams(max_new_tokens=1))
        engine.run_until_idle()
        ids = [engine.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
        engine.run_until_idle()
        mismatches = 0
        for request_id, prompt in zip(ids, prompts):
            got = list(engine.get(request_id).output_token_ids)
            config = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
            with torch.inference_mode():
                out = reference.model.generate(input_ids=torch.tensor([prompt], device=s.device), generation_config=config)
            mismatches += got != out[0, len(prompt):].tolist()
        hits = [engine.get(i).cached_tokens for i in ids]
        return {"requests": len(ids), "token_mismatches": mismatches, "cached_tokens": hits, "passed": mismatches == 0}

    result = guarded(report, "reference", "engine end to end", one)
    if result is not None:
        report.add("reference", "engine end to end", result,
                   f"  engine end to end (tiny-llama fp32, prefix hits): {'pass' if result['passed'] else 'FAIL'}, "
                   f"{result['token_mismatches']} of {result['requests']} requests differ from generate; cached {result['cached_tokens']}")


# ---------------------------------------------------------------------------------------------- 3. benchmark
@dataclass(frozen=True)
class DecodeRun:
    """One system's N concurrent forks: first tokens, then decoding."""

    ttft_s: float  # mean time from t0 to each request's first token
    decode_tokens_per_s: float  # tokens after the first, once every request has its first, per second
    e2e_s: float  # t0 to the last token
    kv_bytes: int | None  # KV held at the peak (None: the system does not say)
    peak_memory_bytes: int | None  # device memory allocated at the peak beyond what was allocated at t0 (CUDA)


class PeakMemory:
    def __init__(self, device: str) -> None:
        import torch

        self.cuda = device.startswith("cuda")
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def delta(self) -> int | None:
        import torch

        return torch.cuda.max_memory_allocated() - self.base if self.cuda else None


class EngineBench:
    def __init__(self, model_dir: Path, s: Settings, num_blocks: int) -> None:
        from engine.core.config import EngineConfig
        from engine.engine import Engine
        from engine.runner.model_runner import ModelRunner

        config = EngineConfig(
            model=str(model_dir), dtype="bfloat16", device=s.device, block_size=s.block_size, num_blocks=num_blocks,
            max_num_batched_tokens=min(1 << 16, max(s.prefix_len + s.suffix_len, max(s.fork_counts) * s.suffix_len)),
            max_num_seqs=max(s.fork_counts), data_dir=model_dir,
        )  # fmt: skip
        self.engine = Engine(config)
        self.s = s
        self.bytes_per_block = ModelRunner.bytes_per_block(self.engine.loaded, s.block_size)

    def cache_prefix(self, prefix: list[int]) -> None:
        from engine.core.request import SamplingParams

        self.engine.submit(prefix, SamplingParams(max_new_tokens=1))
        self.engine.run_until_idle()

    def ttft(self, prompt: list[int]) -> float:
        from engine.core.request import SamplingParams

        t0 = time.perf_counter()
        request_id = self.engine.submit(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        while not any(v.request_id == request_id for v in self.engine.step()):
            pass
        return time.perf_counter() - t0

    def forks(self, prompts: list[list[int]]) -> DecodeRun:
        from engine.core.request import SamplingParams

        engine, memory = self.engine, PeakMemory(self.s.device)
        t0, t0_epoch = time.perf_counter(), time.time()  # the engine stamps first tokens with time.time()
        ids = [engine.submit(p, SamplingParams(max_new_tokens=self.s.new_tokens, ignore_eos=True)) for p in prompts]
        all_first, peak = None, 0
        while engine.has_work():
            engine.step()
            peak = max(peak, engine.stats().used_blocks)
            if all_first is None and all(engine.get(i).output_token_ids for i in ids):
                all_first = time.perf_counter()
        end = time.perf_counter()
        views = [engine.get(i) for i in ids]
        decoded = sum(len(v.output_token_ids) - 1 for v in views)
        ttft = statistics.fmean(v.first_token_time - t0_epoch for v in views)
        return DecodeRun(ttft, decoded / max(end - all_first, 1e-9), end - t0, peak * self.bytes_per_block, memory.delta())


class HFBench:
    """transformers on the same device: the copy-the-cache recipe (batched) and the cache reused in place."""

    def __init__(self, loaded, s: Settings, prefix: list[int]) -> None:
        import torch
        from transformers import DynamicCache

        self.model, self.s, self.prefix = loaded.model, s, prefix
        with torch.inference_mode():
            ids = torch.tensor([prefix], device=s.device)
            self.prefix_cache = self.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
            self.in_place = self.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).past_key_values

    def suffix_alone(self, suffix: list[int]) -> float:
        import torch

        with torch.inference_mode():
            ids = torch.tensor([suffix], device=self.s.device)
            synchronize(self.s.device)
            t0 = time.perf_counter()
            int(self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].argmax())
            return time.perf_counter() - t0

    def ttft_in_place(self, prompt: list[int]) -> float:
        import torch

        with torch.inference_mode():
            ids = torch.tensor([prompt[len(self.prefix):]], device=self.s.device)
            synchronize(self.s.device)
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, past_key_values=self.in_place, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            elapsed = time.perf_counter() - t0
            self.in_place.crop(-ids.shape[1])  # a negative count removes that many tokens (transformers >= 5.17)
            return elapsed

    def ttft_copy(self, prompt: list[int]) -> float:
        import torch

        with torch.inference_mode():
            ids = torch.tensor([prompt[len(self.prefix):]], device=self.s.device)
            synchronize(self.s.device)
            t0 = time.perf_counter()
            cache = copy.deepcopy(self.prefix_cache)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            return time.perf_counter() - t0

    def forks(self, prompts: list[list[int]]) -> DecodeRun:
        """One `generate` over the N prompts, on N copies of the prefix cache (the recipe, batched)."""
        import torch
        from transformers import DynamicCache, GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            def __init__(self) -> None:
                self.stamps: list[float] = []

            def put(self, value) -> None:
                self.stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        n, clock, memory = len(prompts), Clock(), PeakMemory(self.s.device)
        config = GenerationConfig(do_sample=False, max_new_tokens=self.s.new_tokens, min_new_tokens=self.s.new_tokens,
                                  eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
        with torch.inference_mode():
            ids = torch.tensor(prompts, device=self.s.device)
            synchronize(self.s.device)
            t0 = time.perf_counter()
            cache = DynamicCache()
            for layer_idx, layer in enumerate(self.prefix_cache.layers):
                cache.update(layer.keys.expand(n, -1, -1, -1).contiguous(), layer.values.expand(n, -1, -1, -1).contiguous(), layer_idx)
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                      generation_config=config, streamer=clock)
            synchronize(self.s.device)
            end = time.perf_counter()
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in out.past_key_values.layers)
        first = clock.stamps[1]  # the first put is the prompt
        decoded = n * (self.s.new_tokens - 1)
        return DecodeRun(first - t0, decoded / max(end - first, 1e-9), end - t0, kv, memory.delta())


class CBBench:
    """transformers continuous batching with block sharing; the prefix is cached by a prefix-only request first."""

    def __init__(self, loaded, s: Settings, prefix: list[int], num_blocks: int) -> None:
        import dataclasses

        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model, self.s, self.prefix = loaded.model, s, prefix
        names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        size_field = "page_size" if "page_size" in names else "block_size"  # 5.23 renamed 5.17's block_size
        self.config = ContinuousBatchingConfig(**{size_field: s.block_size}, num_blocks=num_blocks,
                                               max_batch_tokens=max(s.fork_counts) * s.suffix_len, allow_block_sharing=True)
        self.size_field = size_field

    def forks(self, prompts: list[list[int]]) -> DecodeRun:
        from transformers import GenerationConfig

        config = GenerationConfig(do_sample=False, max_new_tokens=self.s.new_tokens, eos_token_id=None, pad_token_id=0)
        warmup = self.s.device.startswith("cuda")
        with self.model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=self.config, block=True, timeout=60, warmup=warmup
        ) as manager:
            manager.add_request(self.prefix, max_new_tokens=2)  # two: a request ending in its prefill never shares
            self._collect(manager, 1)
            memory = PeakMemory(self.s.device)
            t0 = time.perf_counter()
            ids = manager.add_requests(prompts, max_new_tokens=self.s.new_tokens, record_timestamps=True)
            results = self._collect(manager, len(prompts))
            end = time.perf_counter()
        by_id = {r.request_id: r for r in results}
        stamps = [by_id[i].timestamps for i in ids]
        all_first = max(st[0] for st in stamps)
        decoded = sum(len(st) - 1 for st in stamps)
        ttft = statistics.fmean(st[0] - t0 for st in stamps)
        return DecodeRun(ttft, decoded / max(end - all_first, 1e-9), end - t0, None, memory.delta())

    @staticmethod
    def _collect(manager, count: int) -> list:
        results = []
        while len(results) < count:
            result = manager.get_result(timeout=1.0)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"continuous batching failed: {result.error}")
                results.append(result)
            elif result is None and not manager.is_running():
                raise RuntimeError("the continuous batching loop stopped")
        return results


def benchmark(report: Report, s: Settings, budget: Budget) -> None:
    import random

    import torch

    from benchmarks.random_models import write_random_model
    from engine.core.arith import ceil_div
    from engine.core.config import EngineConfig
    from engine.runner.attention_plan import NO_CASCADE
    from engine.runner.model_loading import load_model

    with tempfile.TemporaryDirectory(prefix="cuda-check-model-") as directory:
        t0 = time.perf_counter()
        model_dir = write_random_model(s.shape, Path(directory), dtype=torch.bfloat16, device=s.device)
        report.say(f"benchmark model: Llama-3.2-1B shape{' (dry run: shrunk)' if s.device == 'cpu' else ''}, random weights, "
                   f"bf16, written in {time.perf_counter() - t0:.0f} s; prefix {s.prefix_len}, suffix {s.suffix_len}, "
                   f"{s.new_tokens} new tokens, forks {s.fork_counts}")
        rng = random.Random(0)
        vocab = s.shape["vocab_size"]
        prefix = [rng.randrange(3, vocab) for _ in range(s.prefix_len)]

        def fresh() -> list[int]:  # a suffix no earlier request had
            return [rng.randrange(3, vocab) for _ in range(s.suffix_len)]

        private = ceil_div(s.suffix_len + s.new_tokens, s.block_size)
        num_blocks = s.prefix_len // s.block_size + max(s.fork_counts) * private + 64

        engine = EngineBench(model_dir, s, num_blocks)
        hf_loaded = load_model(EngineConfig(model=str(model_dir), dtype="bfloat16", device=s.device, data_dir=model_dir))
        engine.cache_prefix(prefix)
        hf = HFBench(hf_loaded, s, prefix)
        report.add("benchmark", "setup_s", round(time.perf_counter() - t0, 1))

        # Time to first token, one request alone with the prefix cached, interleaved with its peers.
        engine.ttft(prefix + fresh()), hf.ttft_in_place(prefix + fresh()), hf.ttft_copy(prefix + fresh())
        times: dict[str, list[float]] = {"suffix alone (transformers, no prefix)": [], "engine, prefix cached": [],
                                         "transformers, one cache in place": [], "transformers, copied cache": []}
        for _ in range(s.ttft_reps):
            suffix = fresh()
            times["suffix alone (transformers, no prefix)"].append(hf.suffix_alone(suffix))
            times["engine, prefix cached"].append(engine.ttft(prefix + suffix))
            times["transformers, one cache in place"].append(hf.ttft_in_place(prefix + suffix))
            times["transformers, copied cache"].append(hf.ttft_copy(prefix + suffix))
        floor = statistics.median(times["suffix alone (transformers, no prefix)"])
        report.say(f"\ntime to first token, {s.prefix_len}-token prefix cached, {s.suffix_len}-token suffix (median of {s.ttft_reps}):")
        for name, values in times.items():
            ms = statistics.median(values) * 1e3
            report.add("benchmark", f"ttft_ms {name}", round(ms, 2), f"  {name:40s} {ms:8.2f} ms  {ms / floor / 1e3:5.2f}x the suffix alone")

        report.say(f"\ndecode throughput, N forks of the cached prefix, {s.new_tokens} new tokens each:")
        report.say(f"  {'system':40s} {'N':>4s} {'TTFT':>9s} {'decode tok/s':>13s} {'E2E':>8s} {'KV':>10s} {'peak mem':>10s}")
        systems: list[tuple[str, Callable[[list[list[int]]], DecodeRun], tuple[int, ...]]] = [
            ("engine (cascade)", engine.forks, s.fork_counts),
        ]

        def engine_plain(prompts):
            runner = engine.engine.runner
            rule, runner.cascade = runner.cascade, NO_CASCADE
            try:
                return engine.forks(prompts)
            finally:
                runner.cascade = rule

        systems.append(("engine (cascade off)", engine_plain, s.cascade_off_counts))
        systems.append(("transformers generate, copied cache", hf.forks, s.fork_counts))
        for name, run, counts in systems:
            for n in counts:
                if budget.left() < 30:
                    report.add("benchmark", f"{name} N={n}", "skipped: time budget", f"  {name:40s} {n:4d} skipped (time budget)")
                    continue
                result = guarded(report, "benchmark", f"{name} N={n}", lambda: run([prefix + fresh() for _ in range(n)]))
                if result is not None:
                    add_decode_row(report, name, n, result)
        del hf  # free the copies before continuous batching allocates its cache
        if s.device.startswith("cuda"):
            torch.cuda.empty_cache()
        cb = guarded(report, "benchmark", "continuous batching setup", lambda: CBBench(hf_loaded, s, prefix, num_blocks))
        if cb is not None:
            report.add("benchmark", "cb_config", {cb.size_field: s.block_size, "num_blocks": num_blocks, "allow_block_sharing": True})
        for n in s.fork_counts if cb is not None else ():
            if budget.left() < 60:
                report.add("benchmark", f"CB N={n}", "skipped: time budget", f"  {'transformers CB, block sharing':40s} {n:4d} skipped (time budget)")
                continue
            result = guarded(report, "benchmark", f"CB N={n}", lambda: cb.forks([prefix + fresh() for _ in range(n)]))
            if result is not None:
                add_decode_row(report, "transformers CB, block sharing", n, result)


def add_decode_row(report: Report, name: str, n: int, run: DecodeRun) -> None:
    kv = f"{run.kv_bytes / 2**20:8.1f}MB" if run.kv_bytes is not None else f"{'n/a':>10s}"
    peak = f"{run.peak_memory_bytes / 2**20:8.1f}MB" if run.peak_memory_bytes is not None else f"{'n/a':>10s}"
    report.add("benchmark", f"{name} N={n}", run.__dict__,
               f"  {name:40s} {n:4d} {run.ttft_s * 1e3:7.1f}ms {run.decode_tokens_per_s:13.1f} {run.e2e_s:7.2f}s {kv} {peak}")


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same code paths on the CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default $OUT, else artifacts/cuda-check)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip benchmark cells that would start later")
    parser.add_argument("--wheels", type=Path, default=None, help="unpack these wheels onto sys.path first (device machine)")
    parser.add_argument("--fetch-wheels", type=Path, default=None, help="download the device machine's wheels and exit")
    args = parser.parse_args(argv)
    if args.fetch_wheels is not None:
        return fetch_wheels(args.fetch_wheels)
    if args.wheels is not None:
        use_wheels(args.wheels)
    out_dir = args.out or Path(os.environ.get("OUT") or ROOT / "artifacts" / "cuda-check")
    report = Report(out_dir)
    s = settings_for(args.dry_run)
    budget = Budget(time.perf_counter(), args.budget_s)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        report.say("no CUDA device: run with --dry-run on a machine without one")
        return 2
    torch.manual_seed(0)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "eos_token_id not set": intended
    report.say(f"cuda_check{' --dry-run (CPU, tiny sizes)' if args.dry_run else ''}: results in {out_dir}")
    with tempfile.TemporaryDirectory(prefix="cuda-check-data-") as data_dir:
        guarded(report, "environment", "environment", lambda: environment(report, s))
        report.say("\nreference checks against transformers on the same device:")
        guarded(report, "reference", "reference", lambda: check_reference(report, s, Path(data_dir)))
        guarded(report, "reference", "engine", lambda: check_engine(report, s, Path(data_dir)))
        guarded(report, "benchmark", "benchmark", lambda: benchmark(report, s, budget))
    failed = [k for k, v in report.data.get("reference", {}).items() if isinstance(v, dict) and not v.get("passed", False)]
    report.add("summary", "reference_failures", failed, f"\nreference checks: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}; "
               f"total {time.perf_counter() - report.started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
