"""The engine's torch-free bookkeeping: block pool, KV cache manager, scheduler, requests and events.

Three of its modules (block, eviction, block_pool) may run compiled (build_native.py). Importing the
package first refuses a compiled module older than its source (`engine.native_guard`), so no caller
(the console, the CLI, the tests) runs code that is no longer there.
"""

from engine.native_guard import refuse_stale_modules

refuse_stale_modules()
