"""DSLError: every front-end and code-generation error of CompLL's DSL."""
from __future__ import annotations


class DSLError(Exception):
    """An error in a CompLL spec, located at ``file:line:col``."""

    def __init__(self, message: str, file: str = "<spec>", line: int = 0, col: int = 0):
        self.message = message
        self.file = file
        self.line = line
        self.col = col
        super().__init__(f"{file}:{line}:{col}: error: {message}")
