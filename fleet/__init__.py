"""Fleet mode: watch the prefix caches of vLLM and SGLang servers through their KV events.

No torch, no Streamlit, no storage: this package decodes the servers' ZeroMQ feeds, keeps them in
order, and hands them to sinks. Data flows one way:

    server PUB/ROUTER ──> collector (one subscriber per pod) ──> sinks: FleetIndex, ... ──> pages, commands

Modules, one job each:
  * `events`       the decoded feed: BlockStored / BlockRemoved / AllBlocksCleared, EventBatch, and the
                   collector's records: PodBatch (pod, seq, arrival time, live or replayed), PodReset,
                   PodStatus (the link, as a heartbeat) and PodMetrics (a /metrics scrape).
  * `decode`       the wire format (vLLM's map-tagged and older array-tagged events, SGLang's batches),
                   every size bounded (`DecodeLimits`), each refusal a `FeedError` of a counted kind.
  * `source`       `PodSource`: a pod's endpoints (PUB, replay ROUTER, /metrics), validated.
  * `sinks`        the `BatchSink` protocol the collector feeds.
  * `config`       `CollectorConfig`: how the collector listens.
  * `link`         a pod's sockets: the SUB socket and its connection monitor, one replay request.
  * `subscriber`   one pod's thread: sequence order, gaps, catch-ups, duplicates, restart detection.
  * `pod_stats`    `PodStats`, what a subscriber counts.
  * `scraper`      the collector's metrics thread.
  * `collector`    `Collector`: the subscribers, the scraper and one dispatcher thread calling the sinks.
  * `health`       `PodHealth`: live, idle, down, unreachable, silent; which of them are stale.
  * `held_blocks`  one pod's held blocks in one (medium, KV group), with copies, and the prompt walk.
  * `prefix_tree`  the cross-pod prefix tree, merged by token content.
  * `index`        `FleetIndex`, a sink: per pod the held blocks, its link and recent scrapes; `route`
                   (each pod's longest cached prefix of a prompt, capped as vLLM caps a prefix hit) and
                   `route_tiers` (the same across a pod's media: which tier would serve it).
  * `tiers`        the media in speed order (GPU, CPU, DISK / STORAGE) and the tier-by-tier walk.
  * `metrics`      parsing a server's /metrics (prefix-cache counters, KV usage, requests, capacity,
                   residency histograms) and the hit rate between two scrapes.

Seams for what comes next (phase B), so it plugs in without changing what is here:
  * Persistence is another `BatchSink`, next to the index: `Collector(sources, [index, writer])`. The
    writer gets `open_pod(source, at)` (a fleet source row), then every `PodBatch` in order per pod
    (stored / removed events with pod, seq, publisher ts and arrival time; `batch.origin` says live or
    replayed) and `PodReset` (a restarted server: close its open block lifetimes). A block's lifetime
    opens at a BlockStored and closes at the BlockRemoved that takes its last copy; the index's copy
    counting (`fleet.held_blocks.BlockGroup.store/remove`) is the rule to follow, and `HeldBlock.first_stored` is
    the age a removal evicts. Sinks are called from one thread, so a writer batches and commits at its
    own pace; a slow writer back-pressures the pod threads (bounded queue), and what the servers drop
    meanwhile comes back by replay.
  * `python -m cli fleet watch` builds `PodSource`s from `--pod NAME=tcp://HOST:PORT[,replay=...]
    [,metrics=...]`, runs a `Collector` with the writer, and prints `Collector.stats()` (`PodStats`:
    `ready` once a pod's start-up replay is over); `fleet state` reads the database, not this package.
  * Pages read `FleetIndex.pods()` / `blocks()` / `prefix_tree()` / `route(token_ids)` (thread-safe
    snapshots) and `FleetIndex.metrics(pod)` (the recent scrapes) for live views, and the database for
    history. Tokenizing a pasted prompt happens in the page; `route` takes ids.
  * The embedded engine publishing the same feed needs only the wire format in `fleet.decode`'s
    docstring (encoded with msgspec, as vLLM does); this package's decoder and tests then read it too.
"""
