"""`python -m tools.replay`: see tools/replay/cli.py and docs/replay.md."""

import sys

from tools.replay.cli import replay_command

sys.exit(replay_command())
