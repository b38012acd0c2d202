"""python -m hipress.bench.faults as a command: --only one cheap row, --json, the exit code
(non-zero when a row fails), and unknown names refused. The rows themselves are tested in
tests/faults/test_fault_table.py."""
import json
import os
import subprocess
import sys

from hipress.bench import faults

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def bench(*args):
    return subprocess.run([sys.executable, "-m", "hipress.bench.faults", *args], env=ENV, capture_output=True,
                          text=True, timeout=240)


def test_only_one_row_as_json():
    r = bench("--only", "malformed_payloads", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout)
    assert [row["name"] for row in rows] == ["malformed_payloads"]
    row = rows[0]
    assert row["passed"] is True and row["failures"] == [] and row["seconds"] > 0
    assert row["facts"]["results"]["rejected"] > 0 and row["facts"]["results"]["other_count"] == 0
    assert "ValueError" in row["observed"]


def test_table_lists_the_row_and_its_verdict():
    r = bench("--only", "malformed_payloads")
    assert r.returncode == 0, r.stdout + r.stderr
    cells = [c.strip() for c in r.stdout.strip().splitlines()[0].strip("|").split("|")]
    assert cells[0] == "malformed_payloads" and cells[3] == "pass" and cells[4].endswith(" s")


def test_unknown_row_is_refused():
    r = bench("--only", "no_such_row")
    assert r.returncode == 2 and "no_such_row" in r.stderr


def test_a_failed_row_makes_the_exit_code_non_zero(monkeypatch, capsys):
    def broken_promise(row):
        row.failures.append("the promise did not hold")
    monkeypatch.setitem(faults.BY_NAME, "broken", faults.Scenario("broken", "nothing", broken_promise))
    assert faults.main(["--only", "broken"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert faults.main(["--only", "broken", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["passed"] is False


def test_every_row_is_documented():
    with open(os.path.join(ROOT, "docs", "security.md")) as f:
        text = f.read()
    for s in faults.ROWS:
        assert f"| {s.name} |" in text, f"docs/security.md's fault table lacks {s.name}"
