import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parents[1] / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))
ROOT = Path(__file__).resolve().parents[2]  # the repo root, for `benchmark` (the simulator's hand rules)
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
