"""Scripts beside the package (training, benchmarks, replay); not installed with ignis.

Importing it puts the repository's root last on sys.path: the root's other folders (kernels/, config/, backends/,
ipc/) are ignis's own subpackages (installed as ignis.kernels, ...), and first on the path (`python -m tools.X` from
the root) they would shadow installed packages of the same names, such as the `kernels` package transformers imports.
"""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT] + [str(_ROOT)]
