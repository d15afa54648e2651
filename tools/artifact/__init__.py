"""Rebuilding the built-in artifact: corpus, tokenizer, target + MTP training, export. README.md has the commands."""
