"""Small traces shipped with the analyzer (their sources and licence: README.md in this folder)."""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).resolve().parent
# What the Capacity planner page offers: label -> file.
SAMPLES = {
    "Mooncake conversation (sample, 223 requests)": FOLDER / "mooncake_conversation_sample.jsonl",
    "Mooncake synthetic (sample, 185 requests)": FOLDER / "mooncake_synthetic_sample.jsonl",
    "Qwen-Bailian format (8 hand-written requests)": FOLDER / "bailian_sample.jsonl",
}
