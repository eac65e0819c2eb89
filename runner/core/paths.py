"""Where lightfleet's own files are: the project's folders of configs (conf/, experiments/).
Pure: every layer may ask (the compatibility table, Hydra's search path, the run's records of
the code's version)."""
from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"
EXPERIMENTS_DIR = PROJECT_ROOT / "experiments"
