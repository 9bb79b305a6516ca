"""Per-request sampling parameters."""
from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature == 0 means greedy (argmax); otherwise tokens are drawn from
    softmax(logits / temperature) restricted to the top_k largest logits
    (-1 = all) and then to the top_p nucleus. `seed` makes sampling
    reproducible per request; `ignore_eos` keeps generating up to max_tokens.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # `not (x >= 0)` also rejects NaN.
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not self.max_tokens >= 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
