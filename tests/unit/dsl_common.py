"""Shared by the DSL tests: one compile cache for the whole test session (content-addressed)."""
import os
import tempfile

os.environ.setdefault("HIPRESS_COMPLL_CACHE", os.path.join(tempfile.gettempdir(), f"hipress-compll-tests-{os.getuid()}"))
