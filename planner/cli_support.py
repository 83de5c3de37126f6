"""What every roofplan command shares: an argument parser whose errors are one line, exit 2."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag prints ``prog: error: message`` on one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
