"""A request's token ids and its place in the KV cache."""
from enum import Enum, auto
from itertools import count

from impl.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Prompt + generated token ids of one request, plus its block table.

    Token position p lives in block p // block_size of `block_table`, so the
    sequence spans num_blocks = ceil(num_tokens / block_size) blocks.
    `num_cached_tokens` counts leading tokens whose KV was found in the
    prefix cache (always a multiple of block_size, always < num_tokens).
    Only plain attributes, so pickling to worker processes is cheap.
    """

    counter = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int) -> None:
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id: int = next(Sequence.counter)
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens: int = len(token_ids)
        self.num_cached_tokens: int = 0
        self.block_table: list[int] = []
        self.block_size: int = block_size
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.params: SamplingParams = params

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.name}, "
                f"tokens={self.num_prompt_tokens}+{self.num_completion_tokens})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block(self, i: int) -> list[int]:
        """Token ids of block i: positions [i * block_size, (i + 1) * block_size)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"block {i} out of range for {self.num_blocks} blocks")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
