"""The bottom layer: the one chat renderer and Message model, tiny models and the offline tokenizer, and small
shared utilities (hashing, atomic writes, canonical JSON). It imports nothing else of the project."""
