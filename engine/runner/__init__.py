"""The engine's torch side: model loading, the model runner, attention plans and kernels, sampling.

The model runner receives chunks of token ids with their positions and block tables from the engine loop
and returns logits; it never sees requests, hashes or tokenization (those stay in engine/core/ and
serving/). The bookkeeping in engine/core/ imports nothing from here.
"""
