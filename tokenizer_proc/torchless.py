"""transformers, for a process that only tokenizes: imported with torch hidden.

transformers imports torch whenever torch is installed, though its tokenizers never use it,
and that import was most of this process's CPU at start-up (which, on a CPU-only machine,
is taken from the worker loading beside it). A None entry in `sys.modules` makes torch look
absent while transformers is imported; transformers decides once, then, that it has none.
The entry is removed afterwards, so a later `import torch` (xgrammar's, on the first
request with a grammar) still works.

Only the tokenizer process calls this (`load_tokenizer(..., without_torch=True)`, when the
tokenizer has no snapshot yet): in a process that also runs a model (the tests, the offline
Engine), transformers must see torch.
"""

from __future__ import annotations

import os
import sys


def import_transformers_without_torch() -> None:
    if "transformers" in sys.modules or "torch" in sys.modules:
        return  # transformers has already decided, or torch is loaded and costs nothing more
    # transformers' advisory "PyTorch was not found" notice is expected here, not news.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from transformers import AutoTokenizer  # noqa: F401 - the import that checks for torch
    finally:
        del sys.modules["torch"]
