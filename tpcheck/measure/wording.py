"""Values written as a person reads them in a summary or a note, never as Python writes them: a list as words
(``1, 3 and 7``, not ``[1, 3, 7]``), a shape as its sizes (``2 x 8``, not ``[2, 8]`` or ``torch.Size([2, 8])``).
Plain functions of their arguments, importing nothing: a note made in a rank and a line of the summary say a
thing the same way."""
from __future__ import annotations

from typing import Iterable


def in_words(items: Iterable[object], conjunction: str = "and") -> str:
    """``[1]`` -> ``"1"``, ``[1, 3]`` -> ``"1 and 3"``, ``[1, 3, 7]`` -> ``"1, 3 and 7"``; nothing -> ``""``."""
    words = [str(x) for x in items]
    if len(words) < 2:
        return "".join(words)
    return f"{', '.join(words[:-1])} {conjunction} {words[-1]}"


def shape_text(shape: Iterable[int]) -> str:
    """A tensor's shape as its sizes: ``(2, 8)`` -> ``"2 x 8"``; a scalar's (``()``) -> ``"a scalar"``."""
    sizes = [str(int(n)) for n in shape]
    return " x ".join(sizes) if sizes else "a scalar"
