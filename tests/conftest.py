"""Suite-wide settings: tiny models run on one intra-op thread, here and in every engine process a test starts.

For matrices this small a second thread only adds synchronisation, which turns into long stalls on a shared
machine; one thread keeps the suite's time predictable on CI's two cores."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
