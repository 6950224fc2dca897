"""Where the tests find the repository, their data and the scripts, wherever a test file sits in tests/."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
SCRIPTS = ROOT / "scripts"
