"""Builds tests/cpp/test_engine.cc against the engine sources and runs it."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
def test_engine_native(tmp_path):
    exe = tmp_path / "test_engine"
    srcs = ["tests/cpp/test_engine.cc", "csrc/engine/engine.cc", "csrc/engine/timeline.cc",
            "csrc/engine/native_work.cc"]
    subprocess.run(["g++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-Icsrc",
                    *srcs, "-o", str(exe)], cwd=ROOT, check=True, timeout=240)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 passed, 0 failed" in out.stdout
