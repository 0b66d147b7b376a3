"""e2e tests import their helpers from `train_helpers` (this folder is on sys.path)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
