"""Drafter training (`ignis train-drafter`): a dflash2 drafter for a Qwen3.5 checkpoint, from its own completions.

options (the flags) -> prompts (the user's files) -> generate (on-policy completions through the engine) -> taps (the
target's layer outputs) -> recipe + loop (the DFlash block and selector losses, budget, checkpoints; memory sizes the
micro-batch) -> shortlist (optional head) -> evaluate (dflash2 against off, through the engine); run ties them.
Nothing here is imported by serving.
"""
