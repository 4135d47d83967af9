"""What the engine tells the outside world when its configuration asks: vLLM's KV events on ZeroMQ and
a Prometheus /metrics endpoint (engine/feeds/outbound.py opens both). Each listens to the engine's events;
none of them changes the engine.
"""
