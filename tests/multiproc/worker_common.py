"""Shared by the multi-process test workers (run as scripts from this directory)."""
import json
import os

from hipress import config


def emit(d):
    """One RESULT line on stdout, and a file when HIPRESS_TEST_RESULT_DIR is set (mpirun and
    horovodrun may interleave or prefix the output lines of different ranks)."""
    line = json.dumps(d)
    print("RESULT " + line, flush=True)
    where = config.get("HIPRESS_TEST_RESULT_DIR")
    if where:
        with open(os.path.join(where, f"rank{d['rank']}.json"), "w") as f:
            f.write(line)
