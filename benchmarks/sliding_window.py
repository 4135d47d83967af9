"""Sliding-window memory and hit latency on a hybrid model: window release and bounded replay next to
keeping every sliding block, side by side in one run on the same prompts.

Model: SmolLM2-135M-Instruct weights run as a hybrid ("hybrid:W": even layers sliding with window W,
odd layers full attention), W=256, block size 16, fp32, device "auto". Three systems, each its own engine
over the same loaded weights:

    (1) release + exact      window release, retention of W + backtrack tokens (backtrack 0), exact replay
    (2) release + approx     the same, approximate replay allowed (bounded: h - r <= W + backtrack); every
                             approximate replay is verified against a from-scratch forward (verify_replay)
    (3) keep every block     baseline. The engine has no switch that keeps a live table's sliding blocks, so
                             the baseline is the same hybrid model with window_backtrack = 65536 (the largest
                             allowed): retention then drops no sliding state, so every hit finds its window
                             state ready and the sliding group holds one block per block of context. Its live
                             tables still release blocks that leave the window, but those stay cached
                             (unreferenced), so they are counted as held (not free). The held count is checked
                             against the table a keep-all engine would hold: one sliding block per full-group
                             block of the same request.

Workloads:

    (a) long generation  a 512-token prompt generates 128 tokens (EOS ignored; retained at the end so its
                         tables can be read): sliding memory at the end, blocks x bytes per sliding block.
                         Run on (1) and (3); (2) differs from (1) only in how hits are planned.
    (b) hits             a 1,024-token document D is cached the way two earlier readers leave it: one read
                         D[:512], then one read all of D (its first half a hit). (1)/(2) keep window state
                         at 512 and at 1,024 (W tokens before each), (3) keeps all of it. Then a request
                         D[:h] + 32 fresh tokens generating 4:
                             cold    the same prompt as "ready" under a fresh salt (nothing hit); the same
                                     work on every system, so one run per repetition, on each system in turn
                             ready   h = 1024, window state ready at the cached end
                             h=896   window state only at 512: exact replays [512, 896), approximate (when
                                     allowed) replays the bounded suffix [640, 896)
                         TTFT: wall time from submit to the end of the step that sampled the first token, the
                         engine stepped in the foreground. Memory right after that step, per group: used
                         (referenced), cached (in the prefix index), held (not free).
                         A plan map shows (mode, r) every system plans at more hit positions, and (2) plans the
                         next turn of its first approximately replayed request (planning only, no forward:
                         `plan_hit` has no side effects).

Order: each system builds D once on an empty cache (building costs a 1,024-token prefill per system); every
repetition then runs cold, ready, h=896. Neither probe changes the window state the next one's plan reads:
the ready probe's blocks start after D, and the tail a replay probe retains ends past h, so it is never ready
at h (every plan is checked against the expected one and any difference is printed). Blocks the earlier probes
leave cached show in the "cached" columns; memory is taken from the first repetition, and a footnote counts
the ready probe's blocks. Systems have their own engines, so each step is interleaved across systems in
rotating order and TTFT medians are reported (timings on a shared machine are noisy). Torch runs on
`--threads` threads (default 1: on 2 shared, loaded cores 2 threads ran several times slower).

Run: `.venv/bin/python benchmarks/sliding_window.py` (4 to 5 minutes on 2 loaded cores), or `--quick` (the
seeded "tiny-llama" preset as a hybrid, W=32, block size 4, all lengths scaled down) for a smoke test.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing reaches a hub

import torch  # noqa: E402

from engine.core.arith import ceil_div  # noqa: E402
from engine.core.chain_keys import ChainKeys  # noqa: E402
from engine.core.config import MAX_BATCHED_TOKENS, EngineConfig, default_data_dir  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.core.kv_groups import FULL, SLIDING, HitPlan  # noqa: E402
from engine.runner.model_runner import ModelRunner  # noqa: E402
from engine.runner.model_loading import SMOLLM2_CACHE_NAME, LoadedModel, load_model  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.core.snapshot import GroupStats  # noqa: E402

TEST_CACHE = REPO / "data" / "test-cache"
DOC_MODULES = ("argparse", "json", "subprocess", "unittest", "itertools", "heapq", "difflib", "collections", "functools")
QUESTION = (
    "\n\nQuestion {n}: looking back at the text above, which part would a new reader find hardest, what example "
    "would make it clearer, and how would you rewrite the first paragraph so that it reads well on its own?"
)
COLD, READY, REPLAY = "cold", "ready", "replay"
ANY_SYSTEM = "(any; no hit)"  # cold probes: the same work on every system


# ---------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    model: str  # preset name
    window: int  # W of the sliding layers
    block_size: int  # tokens per KV block
    doc_len: int  # D: the cached document, in tokens
    checkpoint_len: int  # an earlier request read D[:checkpoint_len]: window state stays cached there
    suffix_len: int  # fresh tokens a hit request adds after its hit position
    new_tokens: int  # tokens a hit request generates (approximate replay's divergence is measured over them)
    gen_prompt_len: int  # (a) prompt length
    gen_new_tokens: int  # (a) tokens generated
    reps: int  # interleaved repetitions of the hit scenarios
    num_blocks: int  # blocks per KV group pool

    @property
    def replay_h(self) -> int:
        """The hit position of the replay scenario: half a window before the document's end."""
        return self.doc_len - self.window // 2

    def hit_position(self, scenario: str) -> int:
        return {COLD: 0, READY: self.doc_len, REPLAY: self.replay_h}[scenario]

    def label(self, scenario: str) -> str:
        return f"h={self.replay_h}" if scenario == REPLAY else scenario

    @property
    def plan_points(self) -> list[int]:
        """Hit positions of the plan map, block-aligned, from the checkpoint to the document's end."""
        s, w, bs = self, self.window, self.block_size
        points = {s.checkpoint_len, s.checkpoint_len + w // 2, s.doc_len - w, s.doc_len - 3 * w // 4,
                  s.doc_len - w // 2, s.doc_len - w // 4, s.doc_len - bs, s.doc_len}
        return sorted(p for p in points if s.checkpoint_len <= p <= s.doc_len and p % bs == 0)


FULL_RUN = Settings("smollm2", 256, 16, 1024, 512, 32, 4, 512, 128, reps=3, num_blocks=320)
QUICK_RUN = Settings("tiny-llama", 32, 4, 128, 64, 8, 4, 64, 32, reps=3, num_blocks=320)


@dataclass(frozen=True)
class SystemSpec:
    label: str
    backtrack: int  # window_backtrack
    allow_approximate: bool  # also turns verify_replay on


RELEASE_EXACT = SystemSpec("(1) release + exact", 0, False)
RELEASE_APPROX = SystemSpec("(2) release + approx", 0, True)
KEEP_ALL = SystemSpec("(3) keep every block", MAX_BATCHED_TOKENS, False)
SYSTEMS = (RELEASE_EXACT, RELEASE_APPROX, KEEP_ALL)


def expected_plan(s: Settings, system: SystemSpec, h: int) -> tuple[str, int]:
    """The (mode, r) the planner's rules give for a hit at h on D as built, worked out from what is cached.

    Cached window state: (1)/(2) right before the checkpoint and right before the document's end (W tokens
    each); (3) everywhere. Exact replay starts at the last ready point below h; approximate replay at
    h - W - backtrack rounded up to a block, and only when that is later than the exact start.
    """
    if h == 0:
        return "none", 0
    if system.backtrack >= s.doc_len or h in (s.checkpoint_len, s.doc_len):
        return "ready", h
    exact_r = s.checkpoint_len
    bound = max(0, h - s.window - system.backtrack)
    approx_r = ceil_div(bound, s.block_size) * s.block_size
    if system.allow_approximate and approx_r > exact_r:
        return "approximate", approx_r
    return "exact", exact_r


# ---------------------------------------------------------------------------------------------- prompts
class Texts:
    """The document, the long-generation prompt and fresh suffixes, as token ids."""

    def __init__(self, loaded: LoadedModel, s: Settings) -> None:
        self._tokenizer = loaded.tokenizer
        self._s = s
        self._vocab_size = loaded.vocab_size
        need = s.doc_len + s.gen_prompt_len
        if self._tokenizer is None:
            rng = random.Random(0)
            ids = [rng.randrange(3, self._vocab_size) for _ in range(need)]
        else:
            text = "\n\n".join(importlib.import_module(m).__doc__ or "" for m in DOC_MODULES)
            ids = list(self._tokenizer(text)["input_ids"])
            if len(ids) < need:
                raise ValueError(f"the source text has {len(ids)} tokens, fewer than {need}")
        self.doc = ids[: s.doc_len]
        self.gen_prompt = ids[s.doc_len : need]

    def suffix(self, n: int) -> list[int]:
        if self._tokenizer is None:
            rng = random.Random(1000 + n)
            return [rng.randrange(3, self._vocab_size) for _ in range(self._s.suffix_len)]
        ids = list(self._tokenizer(QUESTION.format(n=n + 1), add_special_tokens=False)["input_ids"])
        if len(ids) < self._s.suffix_len:
            raise ValueError(f"suffix {n} has {len(ids)} tokens, fewer than {self._s.suffix_len}")
        return ids[: self._s.suffix_len]


# ---------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Probe:
    """One hit-scenario request on one system."""

    request_id: str
    ttft_s: float  # submit to the end of the step that sampled its first token
    h: int
    r: int
    mode: str
    replayed: int  # h - r
    computed: int  # prompt tokens run through the model
    groups: tuple[GroupStats, ...]  # right after the first-token step
    outputs: tuple[int, ...]
    divergence: dict[str, float] | None


@dataclass(frozen=True)
class FollowUp:
    """How a follow-up turn on an approximately replayed request would be planned (no forward run)."""

    mode: str
    h: int
    r: int
    sliding_reused: int  # sliding blocks of its plan that the approximate request wrote
    sliding_hits: int  # sliding blocks of its plan
    full_reused: int  # full-group blocks of its plan past the approximate request's h (computed by that request)


@dataclass(frozen=True)
class GenRun:
    """One long generation on one system."""

    end: tuple[GroupStats, ...]  # after the last token, the request retained
    peak_sliding_used: int  # most sliding blocks referenced after any step
    full_table_blocks: int  # the request's full-group table: what a keep-all sliding table holds
    decode_s_per_token: float
    outputs: tuple[int, ...]


def group(groups: tuple[GroupStats, ...], name: str) -> GroupStats:
    return next(g for g in groups if g.name == name)


def held(g: GroupStats) -> int:
    """Blocks not free: referenced by a table, or cached and unreferenced."""
    return g.num_blocks - g.free_blocks


class System:
    """One engine configuration over the shared weights."""

    def __init__(self, spec: SystemSpec, loaded: LoadedModel, s: Settings, data_dir: Path) -> None:
        config = EngineConfig(
            model=s.model,
            device="auto",
            dtype="float32",
            block_size=s.block_size,
            num_blocks=s.num_blocks,
            attention_override=f"hybrid:{s.window}",
            window_backtrack=spec.backtrack,
            allow_approximate_replay=spec.allow_approximate,
            verify_replay=spec.allow_approximate,
            data_dir=data_dir,
        )
        self.spec = spec
        self.engine = Engine(config, loaded=loaded)
        self.s = s
        self.after_setup: tuple[GroupStats, ...] = ()  # D cached, nothing running
        self.setup_sliding_ids: set[int] = set()  # sliding blocks cached when D was built
        self.after_ready: tuple[GroupStats, ...] = ()  # the ready probe finished, before h=replay
        self.plans: dict[int, tuple[str, int, int]] = {}  # plan map: h -> (mode, h, r)
        self.follow_up: FollowUp | None = None  # (2) only: the next turn after its first approximate replay

    def run(self, prompt: list[int], new_tokens: int) -> None:
        self.engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        self.engine.run_until_idle()

    def reset(self) -> None:
        assert self.engine.reset_cache().ok, "nothing may be held between repetitions"

    def plan(self, tokens: list[int]) -> HitPlan:
        """The engine's hit plan for an unsalted request with this context (planning only)."""
        kv = self.engine.kv
        return kv.plan_hit(tokens, ChainKeys(kv.roots.root_key(None), kv.block_size))

    def build_document(self, doc: list[int], plan_suffix: list[int]) -> None:
        """Cache D the way two earlier readers leave it: D[:checkpoint], then all of D."""
        self.run(doc[: self.s.checkpoint_len], 1)
        self.run(doc, 1)
        self.after_setup = self.engine.stats().groups
        self.setup_sliding_ids = {
            b.block_id for b in self.engine.snapshot().blocks if b.group == SLIDING and b.key is not None
        }
        for h in self.s.plan_points:
            plan = self.plan(doc[:h] + plan_suffix)
            self.plans[h] = (plan.mode, plan.h, plan.r)

    def plan_follow_up(self, probe: Probe, prompt: list[int], new_tokens: list[int]) -> FollowUp:
        """Plan (only) the next turn of `probe`'s conversation: its context plus `new_tokens`.

        Blocks it would share that entered the cache after D was built, at positions from `probe.r` on, hold
        state the approximate request computed: only that request ran on this chain since.
        """
        plan = self.plan(prompt + list(probe.outputs) + new_tokens)
        bs = self.s.block_size
        sliding = sum(1 for b in plan.sliding_hits if b.start_pos >= probe.r and b.block_id not in self.setup_sliding_ids)
        return FollowUp(plan.mode, plan.h, plan.r, sliding, len(plan.sliding_hits), len(plan.full_hits) - probe.h // bs)

    def note_after_ready(self) -> None:
        self.after_ready = self.engine.stats().groups

    def probe(self, prompt: list[int], salt: str | None = None) -> Probe:
        """Submit, step until the first token (timed), then finish the request."""
        engine = self.engine
        t0 = time.perf_counter()
        rid = engine.submit(prompt, SamplingParams(max_new_tokens=self.s.new_tokens, ignore_eos=True), salt=salt)
        while not engine.get(rid).output_token_ids:
            engine.step()
        ttft = time.perf_counter() - t0
        groups = engine.stats().groups
        engine.run_until_idle()
        view = engine.get(rid)
        return Probe(
            request_id=rid,
            ttft_s=ttft,
            h=view.cached_tokens,
            r=view.replay_from,
            mode=view.replay_mode,
            replayed=view.replayed_tokens,
            computed=view.computed_tokens,
            groups=groups,
            outputs=view.output_token_ids,
            divergence=view.replay_divergence,
        )

    def long_generation(self, prompt: list[int]) -> GenRun:
        engine = self.engine
        self.reset()
        rid = engine.submit(prompt, SamplingParams(max_new_tokens=self.s.gen_new_tokens, ignore_eos=True), retain=True)
        peak, first_token_at = 0, None
        while engine.has_work():
            engine.step()
            peak = max(peak, group(engine.stats().groups, SLIDING).used_blocks)
            if first_token_at is None and engine.get(rid).output_token_ids:
                first_token_at = time.perf_counter()
        decode_s = (time.perf_counter() - first_token_at) / max(1, self.s.gen_new_tokens - 1)
        end = engine.stats().groups
        view = engine.get(rid)
        run = GenRun(end, peak, len(view.block_tables[FULL]), decode_s, view.output_token_ids)
        engine.release(rid)
        return run


def run_hits(s: Settings, systems: list[System], texts: Texts) -> dict[tuple[str, str], list[Probe]]:
    """Every scenario `s.reps` times; each step interleaved across systems in rotating order.

    Cold is the same work on every system (nothing hit), so it runs once per repetition, on the systems in
    turn, under a fresh salt (a namespace nothing else uses). D is built once per system; later repetitions
    reuse it, since neither probe changes the window state their plans read (the plan check confirms it).
    """
    probes: dict[tuple[str, str], list[Probe]] = {}

    def each(rep: int, step: int, fn) -> None:
        for k in range(len(systems)):
            fn(systems[(rep + step + k) % len(systems)])

    def record(system: System, scenario: str, prompt: list[int], salt: str | None = None) -> None:
        label = ANY_SYSTEM if scenario == COLD else system.spec.label
        probes.setdefault((scenario, label), []).append(system.probe(prompt, salt))

    plan_suffix = texts.suffix(10_000)
    for rep in range(s.reps):
        ready_prompt = texts.doc + texts.suffix(2 * rep)
        replay_prompt = texts.doc[: s.replay_h] + texts.suffix(2 * rep + 1)
        if rep == 0:
            each(rep, 0, System.reset)
        record(systems[rep % len(systems)], COLD, ready_prompt, salt=f"cold-{rep}")
        if rep == 0:
            each(rep, 1, lambda sy: (sy.reset(), sy.build_document(texts.doc, plan_suffix)))
        each(rep, 2, lambda sy: record(sy, READY, ready_prompt))
        if rep == 0:
            each(rep, 3, System.note_after_ready)
        each(rep, 4, lambda sy: record(sy, REPLAY, replay_prompt))
        if rep == 0:
            approx = next(sy for sy in systems if sy.spec is RELEASE_APPROX)
            approx.follow_up = approx.plan_follow_up(probes[REPLAY, RELEASE_APPROX.label][0], replay_prompt,
                                                     texts.suffix(30_000))
    return probes


# ---------------------------------------------------------------------------------------------- report
class Sizes:
    def __init__(self, loaded: LoadedModel, engine: Engine, block_size: int) -> None:
        self.layers = {spec.name: len(spec.layers) for spec in engine.runner.groups}
        self.bytes = {name: ModelRunner.bytes_per_block(loaded, block_size, n) for name, n in self.layers.items()}

    def mb(self, name: str, blocks: int) -> float:
        return blocks * self.bytes[name] / 2**20


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def print_generation(s: Settings, sizes: Sizes, gen: dict[str, GenRun]) -> None:
    release, keep = gen[RELEASE_EXACT.label], gen[KEEP_ALL.label]
    print(
        f"\n(a) Long generation: {s.gen_prompt_len}-token prompt, {s.gen_new_tokens} tokens generated "
        f"({s.gen_prompt_len + s.gen_new_tokens - 1} tokens with KV at the end); memory after the last token"
    )
    print(
        f"  {'system':22s} {'sliding used':>12s} {'sliding held':>12s} {'sliding MB':>10s} {'peak used':>9s} "
        f"{'released':>8s} {'full MB':>8s} {'total MB':>8s} {'decode/token':>12s}"
    )
    totals = {}
    for label, run in gen.items():
        sl, fu = group(run.end, SLIDING), group(run.end, FULL)
        # What each system holds for this context: (1) the blocks its table references; (3) every block it keeps.
        sliding_blocks = held(sl) if label == KEEP_ALL.label else sl.used_blocks
        totals[label] = (sliding_blocks, sizes.mb(SLIDING, sliding_blocks) + sizes.mb(FULL, fu.used_blocks))
        print(
            f"  {label:22s} {sl.used_blocks:12d} {held(sl):12d} {sizes.mb(SLIDING, sliding_blocks):10.2f} "
            f"{run.peak_sliding_used:9d} {sl.window_released_blocks:8d} {sizes.mb(FULL, fu.used_blocks):8.2f} "
            f"{totals[label][1]:8.2f} {run.decode_s_per_token * 1e3:9.1f} ms"
        )
    measured = held(group(keep.end, SLIDING))
    print(
        f"  keep-all check: a table that never releases holds one sliding block per full-group block, "
        f"{keep.full_table_blocks}; (3) holds {measured}: {'match' if keep.full_table_blocks == measured else 'MISMATCH'}"
    )
    (r_blocks, r_mb), (k_blocks, k_mb) = totals[RELEASE_EXACT.label], totals[KEEP_ALL.label]
    bound = ceil_div(s.window - 1, s.block_size) + 1
    print(
        f"  sliding memory, release / keep-all: {r_blocks}/{k_blocks} blocks = {r_blocks / k_blocks:.2f}x "
        f"(window bound ceil((W-1)/bs) + 1 = {bound} blocks); all KV: {r_mb:.2f}/{k_mb:.2f} MB = {r_mb / k_mb:.2f}x"
    )
    same = release.outputs == keep.outputs
    print(f"  decode time, release / keep-all: {release.decode_s_per_token / keep.decode_s_per_token:.2f}x "
          f"(one run each); generated tokens identical: {'yes' if same else 'NO'}")


def print_setup(sizes: Sizes, systems: list[System]) -> None:
    print("\nDocument cached (D[:checkpoint] then D finished; nothing running)")
    print(f"  {'system':22s} {'full cached':>11s} {'sliding cached':>14s} {'full MB':>8s} {'sliding MB':>10s} {'total MB':>8s}")
    for system in systems:
        fu, sl = group(system.after_setup, FULL), group(system.after_setup, SLIDING)
        f_mb, s_mb = sizes.mb(FULL, fu.cached_blocks), sizes.mb(SLIDING, sl.cached_blocks)
        print(f"  {system.spec.label:22s} {fu.cached_blocks:11d} {sl.cached_blocks:14d} {f_mb:8.2f} {s_mb:10.2f} {f_mb + s_mb:8.2f}")
    release = group(systems[0].after_setup, SLIDING).cached_blocks
    keep = group(systems[2].after_setup, SLIDING).cached_blocks
    print(f"  sliding state kept, release / keep-all: {release}/{keep} blocks = {release / keep:.2f}x")


def print_hits(s: Settings, sizes: Sizes, systems: list[System], probes: dict[tuple[str, str], list[Probe]]) -> None:
    print(
        f"\n(b) Hits on the cached {s.doc_len}-token document: prompt D[:h] + {s.suffix_len} fresh tokens, "
        f"{s.new_tokens} generated; TTFT median of {s.reps}; memory right after the first-token step"
    )
    print(
        f"  {'scenario':8s} {'system':22s} {'mode':>11s} {'h':>5s} {'r':>5s} {'replayed':>8s} {'computed':>8s} "
        f"{'TTFT':>10s} {'runs (ms)':>17s} {'x cold':>6s} {'x ready':>7s} {'full used/cached':>16s} {'sliding used/cached':>19s} {'held MB':>8s}"
    )
    cold_runs = probes[COLD, ANY_SYSTEM]
    cold = median_ms([r.ttft_s for r in cold_runs])
    rows = [(COLD, ANY_SYSTEM)] + [(sc, spec.label) for sc in (READY, REPLAY) for spec in SYSTEMS]
    for scenario, label in rows:
        runs = probes[scenario, label]
        p = runs[0]
        ttft = median_ms([r.ttft_s for r in runs])
        spread = f"{min(r.ttft_s for r in runs) * 1e3:.0f}-{max(r.ttft_s for r in runs) * 1e3:.0f}"
        ready_label = RELEASE_EXACT.label if label == ANY_SYSTEM else label
        ready = median_ms([r.ttft_s for r in probes[READY, ready_label]])
        fu, sl = group(p.groups, FULL), group(p.groups, SLIDING)
        held_mb = sizes.mb(FULL, held(fu)) + sizes.mb(SLIDING, held(sl))
        print(
            f"  {s.label(scenario):8s} {label:22s} {p.mode:>11s} {p.h:5d} {p.r:5d} {p.replayed:8d} {p.computed:8d} "
            f"{ttft:7.1f} ms {spread:>17s} {ttft / cold:6.2f} {ttft / ready:7.2f} {f'{fu.used_blocks}/{fu.cached_blocks}':>16s} "
            f"{f'{sl.used_blocks}/{sl.cached_blocks}':>19s} {held_mb:8.2f}"
        )
    on = ", ".join(systems[rep % len(systems)].spec.label.split()[0] for rep in range(len(cold_runs)))
    print(f"  cold: one run per repetition, on {on}, under a fresh salt; its memory from the first, on an empty cache; "
          f"x ready against (1)")
    leftovers = [
        (group(sy.after_ready, FULL).cached_blocks - group(sy.after_setup, FULL).cached_blocks,
         group(sy.after_ready, SLIDING).cached_blocks - group(sy.after_setup, SLIDING).cached_blocks)
        for sy in systems
    ]
    print(
        f"  cached at h={s.replay_h} includes the ready probe's own blocks (full, sliding per system: "
        + ", ".join(f"{f}+{sl}" for f, sl in leftovers) + ")"
    )
    label = s.label(REPLAY)
    ready_same = all(a.outputs == b.outputs for spec in SYSTEMS
                     for a, b in zip(probes[COLD, ANY_SYSTEM], probes[READY, spec.label]))
    exact_same = all(a.outputs == b.outputs for sc in (READY, REPLAY)
                     for a, b in zip(probes[sc, RELEASE_EXACT.label], probes[sc, KEEP_ALL.label]))
    print(f"  greedy tokens: cold = ready on every system: {'yes' if ready_same else 'NO'}; "
          f"(1) exact = (3) keep-all at ready and {label}: {'yes' if exact_same else 'NO'}")
    t = {spec.label: median_ms([r.ttft_s for r in probes[REPLAY, spec.label]]) for spec in SYSTEMS}
    e, a, k = t[RELEASE_EXACT.label], t[RELEASE_APPROX.label], t[KEEP_ALL.label]
    print(f"  TTFT at {label}: exact / keep-all {e / k:.2f}x, approximate / keep-all {a / k:.2f}x, "
          f"approximate / exact {a / e:.2f}x")


def print_divergence(s: Settings, systems: list[System], probes: dict[tuple[str, str], list[Probe]]) -> None:
    print(f"\nApproximate replay on (2), verified against a from-scratch forward over its {s.new_tokens} generated tokens")
    print(
        f"  {'scenario':8s} {'rep':>3s} {'h':>5s} {'r':>5s} {'replayed':>8s} {'max |dlogit|':>12s} {'mean KL':>9s} "
        f"{'max KL':>9s} {'top-1 agree':>11s} {'tokens = exact (1)':>18s}"
    )
    found = False
    for scenario in (READY, REPLAY):
        pairs = zip(probes[scenario, RELEASE_APPROX.label], probes[scenario, RELEASE_EXACT.label])
        for rep, (p, exact) in enumerate(pairs):
            if p.mode != "approximate":
                continue
            found = True
            d = p.divergence or {}
            first_diff = next((i for i, (x, y) in enumerate(zip(p.outputs, exact.outputs)) if x != y), None)
            tokens = "all" if first_diff is None else f"first {first_diff} agree"
            print(
                f"  {s.label(scenario):8s} {rep:3d} {p.h:5d} {p.r:5d} {p.replayed:8d} "
                f"{d.get('max_abs_logit', float('nan')):12.4f} {d.get('mean_kl', float('nan')):9.2e} "
                f"{d.get('max_kl', float('nan')):9.2e} {d.get('top1_agreement', float('nan')):11.3f} {tokens:>18s}"
            )
    if not found:
        print("  (no probe took the approximate path)")
    follow = next(sy for sy in systems if sy.spec is RELEASE_APPROX).follow_up
    if follow is not None:
        print(
            f"  next turn on the rep-0 request (its context + {s.suffix_len} tokens), planned only: mode {follow.mode}, "
            f"h={follow.h}, r={follow.r}; {follow.sliding_reused} of its {follow.sliding_hits} sliding hits and "
            f"{follow.full_reused} full blocks past h={s.replay_h} were written by the approximate request, "
            f"and {'no' if follow.mode != 'approximate' else 'a'} divergence would be recorded for it"
        )


def print_plans(s: Settings, systems: list[System], probes: dict[tuple[str, str], list[Probe]]) -> None:
    print(f"\nPlan map on the cached document (planning only; prompt D[:h] + {s.suffix_len} tokens): mode and r")
    print(f"  {'h':>5s}  " + "  ".join(f"{sy.spec.label:>24s}" for sy in systems))
    unexpected = []
    for h in s.plan_points:
        cells = []
        for sy in systems:
            mode, got_h, r = sy.plans[h]
            cells.append(f"{mode} r={r}")
            if (mode, r) != expected_plan(s, sy.spec, h) or got_h != h:
                unexpected.append(f"plan map h={h} on {sy.spec.label}: expected {expected_plan(s, sy.spec, h)}, "
                                  f"got mode {mode} h={got_h} r={r}")
        print(f"  {h:5d}  " + "  ".join(f"{c:>24s}" for c in cells))
    for (scenario, label), runs in probes.items():
        spec = next((sp for sp in SYSTEMS if sp.label == label), RELEASE_EXACT)  # cold: any system plans "none"
        h = s.hit_position(scenario)
        for rep, p in enumerate(runs):
            if (p.mode, p.r) != expected_plan(s, spec, h) or p.h != h:
                unexpected.append(f"{s.label(scenario)} on {label}, rep {rep}: expected {expected_plan(s, spec, h)} "
                                  f"at h={h}, got mode {p.mode} h={p.h} r={p.r}")
    context = (f"(W={s.window}, block size {s.block_size}, document {s.doc_len}, checkpoint {s.checkpoint_len}, "
               f"suffix {s.suffix_len})")
    if unexpected:
        for line in unexpected:
            print(f"  UNEXPECTED {line} {context}")
    else:
        total = sum(len(r) for r in probes.values()) + len(s.plan_points) * len(systems)
        print(f"  all {total} plans (probes and plan map) are the expected ones {context}")


# ---------------------------------------------------------------------------------------------- main
def resolve_data_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).resolve()
    if (TEST_CACHE / "models" / SMOLLM2_CACHE_NAME).is_dir():
        return TEST_CACHE
    return default_data_dir()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny-llama hybrid, W=32, block size 4: a smoke test")
    parser.add_argument("--reps", type=int, help="repetitions of the hit scenarios (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--data-dir", help="where the converted SmolLM2 lives (default: data/test-cache if present)")
    args = parser.parse_args()
    s = QUICK_RUN if args.quick else FULL_RUN
    if args.reps is not None:
        s = Settings(**{**s.__dict__, "reps": max(1, args.reps)})
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    data_dir = resolve_data_dir(args.data_dir)

    loaded = load_model(
        EngineConfig(model=s.model, device="auto", data_dir=data_dir, attention_override=f"hybrid:{s.window}")
    )
    systems = [System(spec, loaded, s, data_dir) for spec in SYSTEMS]
    sizes = Sizes(loaded, systems[0].engine, s.block_size)
    texts = Texts(loaded, s)
    print(
        f"{s.model} as hybrid:{s.window} on {loaded.device} ({torch.get_num_threads()} torch threads), fp32, block size "
        f"{s.block_size}: {sizes.layers[FULL]} full + {sizes.layers[SLIDING]} sliding layers; one block = "
        f"{sizes.bytes[FULL] / 1024:.0f} KiB in each group; {s.num_blocks} blocks per group"
    )
    for system in systems:  # warm-up, untimed
        system.run(texts.suffix(20_000), 2)

    gen = {}
    for system in (systems[0], systems[2]):
        gen[system.spec.label] = system.long_generation(texts.gen_prompt)
    probes = run_hits(s, systems, texts)

    print_generation(s, sizes, gen)
    print_setup(sizes, systems)
    print_hits(s, sizes, systems, probes)
    print_divergence(s, systems, probes)
    print_plans(s, systems, probes)
    print(f"\ntotal run time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
