"""Shared test setup.

TRITON_INTERPRET must be set before anything imports triton, so that Triton kernels run on
the CPU through Triton's interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
