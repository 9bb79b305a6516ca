"""Random prompts: token ids drawn uniformly from the vocabulary, reproducible from a seed."""
from __future__ import annotations

import random


def random_prompts(vocab: int, batch: int, seq_len: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``seq_len`` token ids in ``[0, vocab)`` from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(seq_len)] for _ in range(batch)]
