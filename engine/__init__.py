"""The prefix-cache engine: block pool, KV cache manager, scheduler, model runner and engine loop.

Nothing in this package imports Streamlit. The block pool and KV cache manager import no torch.
"""
