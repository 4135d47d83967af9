"""Workload analysis: what a prefix cache of a given size would hit on a trace, under which eviction
policy, how far that is from the best possible, and why the rest misses.

No torch, no Streamlit, no storage. Data flows one way:

    readers      file -> TraceRequest, one per line (bounded line length, errors name the line)
    trace        TraceRequest... -> Trace: columns of block ids, in arrival order
    sequential   Trace x policy x capacity -> PolicyRun (leading hit blocks per request)
    stack_distance  Trace -> LruCurve: LRU at every capacity from one pass
    breakdown    PolicyRun -> misses by reason, hits per request type, top prefixes
    analyzer     Trace x AnalysisConfig -> Analysis (progress callback for long runs)
    report       Analysis -> the JSON the CLI prints

Modules: `errors` (TraceError, NoVictimError), `trace`, `readers`, `keyed_heap` (the heap behind FIFO,
LFU and OPT), `policies` (the policy contract, LRU, FIFO, LFU, reuse-LRU), `belady` (OPT),
`sequential`, `stack_distance`, `breakdown`, `analyzer`, `report`.

Seams for what comes next (the engine's block pool, timed mode, own workloads, CLI and page):

  * Policies in the block pool. `policies.EvictionPolicy` is written against a pool's events, not the
    simulator's: insert (a block is keyed into the index), touch (a prefix hit, reference 0 -> 1 or
    more), release (the last reference dropped: it joins the evictable set), victim + remove (evict
    when no free block is left), remove (a block leaves the index out of turn). Keys are any hashable,
    so the pool passes its chain keys and a policy's memory of evicted keys (reuse-LRU's history)
    means the same content coming back. `make_policy(Policy, capacity_blocks)` builds an online one
    (OPT also needs the trace: it reads the future).
  * The LRU simulation through the pool. `sequential.replay(trace, cache)` drives any object with
    `serve(blocks) -> leading hit blocks`; an adapter over the engine's pool with that method replays a
    trace through it, and a test compares its `hit_blocks` with `simulate(trace, Policy.LRU, C)` and
    with `LruCurve.hit_blocks(C)` (which the tests here already prove equal to each other).
  * Own workloads (run-trace files, the history database). Their readers yield `TraceRequest`s whose
    `block_ids` are the engine's full-block chain keys (as integers) and build the trace with
    `PartialBlocks.DROPPED`; the block counts are then checked as `input_length // block_size` and the
    tail past the last full block is counted as `MissBreakdown.partial` with no other change. New
    `TraceFormat` members name the formats; `readers._PARSERS` maps a format to its line parser.
    `MissBreakdown.namespace` is the slot for their namespace misses.
  * Timed mode. A second runner beside `sequential.simulate` returns the same `PolicyRun` (so every
    breakdown applies unchanged) plus its queueing delays and peak blocks in use; its misses for want
    of room go to `MissBreakdown.pinned`. The policies already separate held from evictable blocks, so
    overlapping requests need nothing new from them.
  * CLI and page. `readers.parse_format` and `load_trace` (a `TraceError` carries `.line`: exit 2),
    `AnalysisConfig`, `analyze(trace, config, progress)` (a `Progress(stage, done, total)` per tick;
    the callback may raise to cancel), `report.to_json`. The page's curve is
    `lru_curve(trace).hit_tokens_at(log_spaced_capacities(trace.unique_blocks, n))`, its "capacity for
    90 % of the maximum" is `LruCurve.min_capacity_for(0.9 * max_hit_tokens)`, and another block size
    of a hash-id trace is `Trace.split(block_size)`.
"""
