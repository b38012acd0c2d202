"""hipress.config: one table of every HIPRESS_* variable, one parser.

The table, the code and the README must agree: every HIPRESS_* name in the repository's
code and docs is a variable of the table (or an allow-listed C++ macro), every variable is
read somewhere, Python reads go through config.get, and the README's option tables are
exactly the generated ones.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hipress import config
from hipress.config import VARIABLES, ConfigError

ROOT = Path(__file__).resolve().parents[2]
BY_NAME = {v.name: v for v in VARIABLES}

# HIPRESS_* names that are not environment variables.
NOT_VARIABLES = {
    "HIPRESS_BINDINGS",             # C++ macro: a seam adds its pybind11 bindings (csrc/bindings/registry.h)
    "HIPRESS_REGISTER_COMPRESSOR",  # C++ macro: an algorithm registers itself (csrc/compress/compressor.h)
    "HIPRESS_RNG_FN",               # C++ macro: host and device qualifiers of the shared RNG (csrc/compress/rng.h)
    # HIPRESS_WITH_CUDA and HIPRESS_WITH_MPI are also -D macros of the build, but they are
    # variables first (setup.py reads them), so they are in the table and not here.
}

# Files that still read HIPRESS_* variables with os.environ: the DSL is being rewritten
# elsewhere; remove an entry once its reads go through config.get. setup.py runs before
# the package is built and cannot import it.
RAW_READS_ALLOWED = {
    "setup.py",  # runs before the package is built
}

CODE_SUFFIXES = {".py", ".sh", ".cc", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".c"}
SKIP_DIRS = {"build", "dist", "__pycache__", "node_modules", "venv"}  # and hidden folders but .ci
THIS_FILE = Path(__file__).resolve()
NAME_RE = re.compile(r"\bHIPRESS_[A-Z0-9_]*[A-Z0-9]\b")


def _is_code(path: Path) -> bool:
    if path.suffix in CODE_SUFFIXES:
        return True
    if path.suffix == "":  # scripts without a suffix (.ci/run)
        try:
            with open(path, "rb") as f:
                return f.read(2) == b"#!"
        except OSError:
            return False
    return False


def _files(want):
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                       and (not d.startswith(".") or d == ".ci")]
        for fn in filenames:
            p = Path(dirpath) / fn
            if p.resolve() != THIS_FILE and want(p):
                yield p


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


CODE = {_rel(p): p.read_text(errors="replace") for p in _files(_is_code)}
DOCS = {_rel(p): p.read_text(errors="replace") for p in _files(lambda p: p.suffix == ".md")}


def test_the_scan_sees_the_repository():
    # guards the tests below against scanning nothing
    assert {"setup.py", "hipress/config.py", "hipress/engine.py", "scripts/setup.sh",
            "csrc/compress/thread_pool.cc"} <= set(CODE)
    assert "README.md" in DOCS


# ---------------------------------------------------------------- table <-> repository
def test_every_name_in_code_and_docs_is_a_variable():
    unknown = {}
    for rel, text in {**CODE, **DOCS}.items():
        for name in set(NAME_RE.findall(text)) - set(BY_NAME) - NOT_VARIABLES:
            unknown.setdefault(name, []).append(rel)
    assert not unknown, f"HIPRESS_* names missing from hipress/config.py's table: {unknown}"


def _read_patterns(name: str):
    n = re.escape(name)
    q = r"""["']"""
    return [
        rf"\b(?:get|_setting|getenv|_flag|ParallelCompile)\(\s*{q}{n}{q}",  # config.get, os.environ.get, C++ getenv, setup.py
        rf"\benviron\[\s*{q}{n}{q}\s*\](?!\s*=[^=])",                     # os.environ["X"] (not an assignment)
        rf"\$\{{{n}\b",                                                    # shell ${X:-default}
        rf"\bis_on {n}\b",                                                 # shell boolean (scripts/*.sh)
    ]


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_every_variable_is_read_somewhere(name):
    readers = [rel for rel, text in CODE.items() if rel != "hipress/config.py"
               and any(re.search(p, text) for p in _read_patterns(name))]
    assert readers, f"{name} is in the table but nothing reads it"


RAW_READ = re.compile(r"""(?:\benviron\.get|\bgetenv)\(\s*["']HIPRESS_|\benviron\[\s*["']HIPRESS_[A-Z0-9_]+["']\s*\](?!\s*=[^=])""")


def test_python_reads_go_through_config():
    raw = RAW_READ
    offenders = sorted(rel for rel, text in CODE.items()
                       if rel.endswith(".py") and rel not in RAW_READS_ALLOWED and raw.search(text))
    assert not offenders, f"read HIPRESS_* with os.environ instead of hipress.config.get: {offenders}"


def test_allow_lists_are_not_stale():
    for rel in RAW_READS_ALLOWED:
        assert rel in CODE and RAW_READ.search(CODE[rel]), f"{rel} (RAW_READS_ALLOWED) reads no HIPRESS_* any more"
    everywhere = "\n".join(CODE.values())
    for name in NOT_VARIABLES:
        assert name in everywhere, f"{name} (NOT_VARIABLES) is not used any more"
        assert name not in BY_NAME


def test_table_is_well_formed():
    assert len(BY_NAME) == len(VARIABLES), "a variable is listed twice"
    for v in VARIABLES:
        assert NAME_RE.fullmatch(v.name), v.name
        assert v.group in ("run", "build", "test"), v
        assert v.meaning.strip(), v.name
        if v.default is not None:
            # the default is what the parser makes of its own text
            shown = ("1" if v.default else "0") if isinstance(v.default, bool) else str(v.default)
            assert config.get(v.name, {v.name: shown}) == v.default, v.name


# ---------------------------------------------------------------- README
def test_readme_has_exactly_the_generated_tables():
    readme = (ROOT / "README.md").read_text()
    tables = {g: config.markdown_table(g) for g in ("build", "run", "test")}
    for group, table in tables.items():
        assert readme.count(table) == 1, (f"README.md lacks the generated {group!r} table: "
                                          f"python -m hipress.config --markdown {group}")
    generated_rows = {row for t in tables.values() for row in t.splitlines()}
    stray = [line for line in readme.splitlines()
             if line.startswith("| `HIPRESS_") and line not in generated_rows]
    assert not stray, f"README.md rows about variables that are not generated: {stray}"


def test_markdown_rows_have_four_cells():
    for g in ("build", "run", "test"):
        for row in config.markdown_table(g).splitlines():
            cells = re.split(r"(?<!\\)\|", row)
            assert len(cells) == 6, row  # '' + 4 cells + ''


def test_cli_prints_the_tables():
    out = subprocess.run([sys.executable, "-m", "hipress.config", "--markdown", "run"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == config.markdown_table("run")


# ---------------------------------------------------------------- parsing
BOOLS = sorted(v.name for v in VARIABLES if v.kind == "bool")
TRUE = ["1", "true", "TRUE", "True", "yes", "Yes", "on", "ON", " on "]
FALSE = ["0", "false", "False", "no", "NO", "off", "Off", "0 "]
NOT_BOOL = ["2", "-1", "y", "n", "enabled", "maybe", "truee", "o"]


def test_there_are_booleans():
    assert {"HIPRESS_COORDINATOR", "HIPRESS_TRANSPORT_CHECK", "HIPRESS_CLUSTER_FALLBACK"} <= set(BOOLS)


@pytest.mark.parametrize("name", BOOLS)
def test_booleans_parse_one_way(name):
    for raw in TRUE:
        assert config.get(name, {name: raw}) is True, raw
    for raw in FALSE:
        assert config.get(name, {name: raw}) is False, raw
    for raw in NOT_BOOL:
        with pytest.raises(ConfigError, match=name) as e:
            config.get(name, {name: raw})
        assert repr(raw) in str(e.value)


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "", "inf", "nan", "1e-3", "2.5"])
def test_timeout(raw):
    if raw in ("0", "-1", "abc", "inf", "nan"):
        with pytest.raises(ConfigError, match="HIPRESS_TIMEOUT_S"):
            config.get("HIPRESS_TIMEOUT_S", {"HIPRESS_TIMEOUT_S": raw})
    else:
        assert config.get("HIPRESS_TIMEOUT_S", {"HIPRESS_TIMEOUT_S": raw}) == (float(raw) if raw else 60.0)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_defaults_when_unset_or_empty(name):
    var = BY_NAME[name]
    assert config.get(name, {}) == var.default
    if var.empty_is_value:
        assert config.get(name, {name: ""}) == ""
    else:
        assert config.get(name, {name: ""}) == var.default
        assert config.get(name, {name: "   "}) == var.default


def test_some_defaults():
    env = {}
    assert config.get("HIPRESS_TIMEOUT_S", env) == 60.0
    assert config.get("HIPRESS_TRANSPORT_CHECK", env) is True
    assert config.get("HIPRESS_COORDINATOR", env) is None  # unset: the optimizer decides (measured or off)
    assert config.get("HIPRESS_COORDINATOR", {"HIPRESS_COORDINATOR": "0"}) is False
    assert config.get("HIPRESS_COMPRESS_THREADS", env) == 1
    assert config.get("HIPRESS_NP", env) == 4
    assert config.get("HIPRESS_CLUSTER_DELAY", env) == "auto"
    assert config.get("HIPRESS_BATCH_COMPUTE_BYTES", env) == 256 << 10
    assert config.get("HIPRESS_MARCH", env) == "native"
    assert config.get("HIPRESS_TIMELINE", env) is None


def test_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("HIPRESS_TIMEOUT_S", "2.5")
    assert config.get("HIPRESS_TIMEOUT_S") == 2.5
    monkeypatch.setenv("HIPRESS_TIMEOUT_S", "0")
    with pytest.raises(ConfigError, match="HIPRESS_TIMEOUT_S='0'"):
        config.get("HIPRESS_TIMEOUT_S")
    monkeypatch.delenv("HIPRESS_TIMEOUT_S")
    assert config.get("HIPRESS_TIMEOUT_S") == 60.0


def test_choices_and_numbers():
    assert config.get("HIPRESS_CLUSTER_DELAY", {"HIPRESS_CLUSTER_DELAY": "NetEm"}) == "netem"
    assert config.get("HIPRESS_CLUSTER_DELAY", {"HIPRESS_CLUSTER_DELAY": "none"}) == "none"
    with pytest.raises(ConfigError, match="HIPRESS_CLUSTER_DELAY='tc'.*auto, netem, nfqueue, nfqueue-python, none"):
        config.get("HIPRESS_CLUSTER_DELAY", {"HIPRESS_CLUSTER_DELAY": "tc"})
    for raw in ("0", "-2", "two", "1.5"):
        with pytest.raises(ConfigError, match="HIPRESS_NP"):
            config.get("HIPRESS_NP", {"HIPRESS_NP": raw})
    assert config.get("HIPRESS_COMPRESS_THREADS", {"HIPRESS_COMPRESS_THREADS": "-1"}) == -1
    with pytest.raises(ConfigError, match="HIPRESS_COMPRESS_THREADS"):
        config.get("HIPRESS_COMPRESS_THREADS", {"HIPRESS_COMPRESS_THREADS": "4x"})
    with pytest.raises(ConfigError, match="HIPRESS_BATCH_COMPUTE_BYTES"):
        config.get("HIPRESS_BATCH_COMPUTE_BYTES", {"HIPRESS_BATCH_COMPUTE_BYTES": "-1"})


def test_unknown_name():
    with pytest.raises(KeyError, match="HIPRESS_NO_SUCH_THING is not a hipress setting"):
        config.get("HIPRESS_NO_SUCH_THING")


# ---------------------------------------------------------------- readers outside Python agree
def _is_on_function(script: str) -> str:
    text = CODE[script]
    m = re.search(r"^is_on\(\) \{.*?^\}$", text, re.S | re.M)
    assert m, f"{script} lost its is_on helper"
    return m.group(0)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", ["scripts/common.sh"])
def test_shell_booleans_parse_like_config(script):
    cases = [(raw, "on") for raw in TRUE] + [(raw, "off") for raw in FALSE]
    cases += [("", "default"), ("  ", "default"), (None, "default")] + [(raw, "error") for raw in NOT_BOOL]
    prog = _is_on_function(script) + '\nif is_on X 0; then echo on; else echo off; fi\n'
    for raw, want in cases:
        env = {k: v for k, v in os.environ.items() if k != "X"}
        if raw is not None:
            env["X"] = raw
        out = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, timeout=30, env=env)
        if want == "error":
            assert out.returncode != 0 and "X=" in out.stderr, (raw, out)
        else:
            assert out.returncode == 0, (raw, out.stderr)
            assert out.stdout.strip() == ("off" if want == "default" else want), raw


def _threads_in_children(values):
    """{value: (returncode, stdout, stderr)} of a child per value (None: unset), run side by side
    (each spends seconds importing torch)."""
    code = "from hipress import compression; print(compression.num_threads())"
    procs = {}
    for value in values:
        env = {k: v for k, v in os.environ.items() if k != "HIPRESS_COMPRESS_THREADS"}
        if value is not None:
            env["HIPRESS_COMPRESS_THREADS"] = value
        procs[value] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)
    out = {}
    try:
        for value, p in procs.items():
            stdout, stderr = p.communicate(timeout=120)
            out[value] = (p.returncode, stdout, stderr)
    finally:  # a timeout leaves none of them running
        for p in procs.values():
            p.kill()
    return out


def test_compress_threads_cpp_agrees_with_the_table():
    """The C++ pool (csrc/compress/thread_pool.cc) reads HIPRESS_COMPRESS_THREADS itself."""
    runs = _threads_in_children([None, "", "3", "0", "-1", "four"])
    results = {}
    for value in (None, "", "3", "0", "-1"):
        rc, stdout, stderr = runs[value]
        assert rc == 0, (value, stderr)
        results[value] = int(stdout)
    assert results[None] == results[""] == config.get("HIPRESS_COMPRESS_THREADS", {}) == 1
    assert results["3"] == 3
    assert results["0"] == results["-1"] >= 1  # all hardware threads
    rc, _, stderr = runs["four"]
    assert rc != 0 and "ConfigError" in stderr and "HIPRESS_COMPRESS_THREADS='four'" in stderr
