"""The Qwen3.5 hybrid model: architecture, per-lane cache, checkpoint loading, random checkpoints.

Owns: `config` (ModelConfig from config.json), `model` (HybridModel, MTPHead), `attention` and `gdn` (the two token
mixers), `delta_rule` and `ops` (their arithmetic, with the exact CPU mode), `cache` (LaneCache), `pool` (the attention
K/V pages and block table), `loader`, `random`, and `batch` (the packed-rows contract with the engine). Does not own:
scheduling, sampling, speculation policy (ignis.engine, ignis.backends). Importing it loads nothing heavy and touches no
device.
"""
