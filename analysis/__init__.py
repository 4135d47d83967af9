"""Workload analysis: what a prefix cache of a given size would hit on a trace, under which eviction
policy, how far that is from the best possible, and why the rest misses.

No torch, no Streamlit, no storage. Data flows one way:

    readers      file -> TraceRequest, one per line (bounded line length, errors name the line)
    trace        TraceRequest... -> Trace: columns of block ids, in arrival order
    own_workloads  run-trace file / history rows -> Trace keyed as the engine keys it
    sequential   Trace x policy x capacity -> PolicyRun (leading hit blocks per request); LRU and
                 reuse-LRU through the engine's block pool (pool_replay)
    timed        Trace x engine policy x pool size -> TimedRun (the engine's scheduler, no model)
    stack_distance  Trace -> LruCurve: LRU at every capacity from one pass
    tiers        Trace x pool x disk tier -> TierRun: two LRU tiers simulated directly (this engine's rule)
    tier_plan    LruCurve x (pool, tier GiB) -> TierPoint: the two-tier hit ratio, loads against prefill saved
    breakdown    PolicyRun -> misses by reason, hits per request type, top prefixes
    analyzer     Trace x AnalysisConfig -> Analysis (progress callback for long runs)
    report       Analysis -> the JSON the CLI prints

Modules: `errors` (TraceError, NoVictimError), `trace`, `readers` (hash-id files), `own_workloads`
(run-trace files and the history: the engine's own keys, content ids for namespace misses), `keyed_heap`
(the heap behind FIFO, LFU and OPT), `policies` (the simulator's contract, FIFO, LFU), `belady` (OPT),
`tiers`, `tier_plan` (a disk tier behind the pool), `pool_replay` (the engine's block pool serving a trace: LRU and reuse-LRU have one implementation each,
the engine's, in engine/core/eviction.py), `sequential`, `stack_distance`, `timed` (the engine's scheduler and
pool without the model), `breakdown`, `analyzer` (both modes), `report`, `samples` (shipped traces).

Data flows from the readers through `analyze` to `report.to_json` (the CLI, `python -m cli analyze`) or to
the Capacity planner page (app/planner.py runs it on a background thread of the browser session).
"""
