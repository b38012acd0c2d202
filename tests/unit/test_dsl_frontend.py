"""CompLL DSL front end: errors carry file:line:col and a plain message; fuzzing never crashes or hangs."""
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsl_common  # noqa: F401
from hipress import compll
from hipress.dsl import DSLError
from hipress.dsl.checker import check_source as check
from hipress.dsl.lexer import PUNCT

OK = """
param P { float threshold = 0.1; }
float tau;
uint2 code(float x) { return x > tau ? 1 : (x < -tau ? 2 : 0); }
float value(uint2 c) { return c == 1 ? tau : (c == 2 ? -tau : 0.0); }
void encode(float* gradient, uint8* compressed, P params) {
    tau = params.threshold;
    uint2* q = map(gradient, code);
    compressed = concat(tau, q);
}
void decode(uint8* compressed, float* gradient) {
    extract(compressed, tau, q);
    gradient = map(q, value);
}
"""


def err(src):
    with pytest.raises(DSLError) as e:
        check(src, "t.cll")
    return e.value


def test_ok_spec_checks():
    s = check(OK, "t.cll")
    assert s.name == "t" and s.param_names == ["threshold"] and s.algo_id >= 64


@pytest.mark.parametrize("src,line,col,msg", [
    ("float x = 1.0 @", 1, 15, "unexpected character '@'"),
    ("param P { float a }", 1, 19, "expected ';' after a parameter"),
    ("float f(float x) { for (;;) {} }", 1, 20, "loops are not part of the DSL"),
    ("void encode(float* g, uint8* c) {\n  c = concat(y);\n}", 2, 14, "'y' is not declared"),
    ("void encode(float* g, uint8* c) {\n  float z = 1;\n}", 3, 0, None),
    ("void encode(float* g, uint8* c) {\n  c = concat(1 % 2.0);\n}", 2, 16, "needs integers"),
    ("float f(float x) { return f(x); }\nvoid encode(float* g, uint8* c) { c = concat(f(1.0)); }", 1, 1,
     "recursive"),
    ("void encode(float* g, uint8* c) { c = concat(1, 2, 3, 4, 5); }", 1, 58, "at most 4 scalars"),
    ("void encode(int32* g, uint8* c) { c = concat(1); }", 1, 13, "must be float*"),
    ("param P { uint8 b = 2; }\nvoid encode(float* g, uint8* c, P p) { c = concat(p.b); }\n"
     "void decode(uint8* c, float* g, P p) { extract(c, x); g = map(g, h); }", 3, 0, None),
    ("uint1 f(float x) { return x > 0; }\nvoid encode(float* g, uint8* c) { uint1* q = map(g, f, 3); c = concat(q); }",
     2, 46, "map(array, udf)"),
    ("void encode(float* g, uint8* c) { float x = reduce(g, nosuch); c = concat(x); }", 1, 55, "user-defined function"),
    ("float y;\nuint1 f(float x) { y = x; return 1; }\nvoid encode(float* g, uint8* c) { c = concat(y); }", 2, 20,
     "cannot write the global"),
])
def test_errors_have_position_and_message(src, line, col, msg):
    e = err(src)
    assert e.file == "t.cll"
    assert e.line >= 1
    if col:
        assert (e.line, e.col) == (line, col), str(e)
    if msg:
        assert msg in e.message, str(e)
    assert str(e).startswith(f"t.cll:{e.line}:{e.col}: error: ")


def test_decode_cannot_read_params():
    src = OK.replace("gradient = map(q, value);", "tau = params.threshold; gradient = map(q, value);").replace(
        "void decode(uint8* compressed, float* gradient)", "void decode(uint8* compressed, float* gradient, P params)")
    e = err(src)
    assert "decode cannot read parameters" in e.message


def test_extract_must_match_concat():
    e = err(OK.replace("extract(compressed, tau, q);", "extract(compressed, q, tau);"))
    assert "concat has" in e.message


def test_cli_check_and_show(tmp_path):
    p = tmp_path / "bad.cll"
    p.write_text("param P {\n  float a;\n}\nvoid encode(float* g, uint8* c, P p) {\n  c = concat(p.b);\n}\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    r = subprocess.run([sys.executable, "-m", "hipress.compll", "check", str(p)], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1 and f"{p}:5:16: error: 'b' is not a parameter" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "hipress.compll", "show", "tbq"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and "hpc_encode" in r.stdout and "threshold_ternary_codes" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hipress.compll", "check", *[os.path.join(compll.SPEC_DIR, s + ".cll")
                                                                            for s in compll.shipped_specs()]],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------- fuzzing
TOKENS = ["param", "P", "{", "}", "float", "int32", "uint1", "uint2", "uint8", "uint", "<", ">", "x", "y", "g", "c",
          "encode", "decode", "map", "reduce", "filter", "concat", "extract", "random", "smaller", "(", ")", ";", ",",
          "=", "return", "if", "else", "1", "2.5", "*", "+", "-", "/", "%", "?", ":", ".", "size", "params", "void",
          "uint8*", "float*", "\n", "//c\n", "\\\n", "algorithm", "state", "!", "&&", "1e40", "0x", "@"]


def fuzz_check(src):
    try:
        check(src, "fuzz.cll")
    except DSLError as e:
        assert e.line >= 0 and e.message
        return False
    return True


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(max_size=200))
def test_fuzz_any_text(src):
    fuzz_check(src)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(TOKENS + PUNCT), max_size=60))
def test_fuzz_token_soup(toks):
    fuzz_check(" ".join(toks))


def mutate(src, data):
    lines = src.split("\n")
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["drop", "dup", "swap", "cut", "insert"]))
        if op == "drop":
            lines.pop(i)
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = data.draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "cut" and lines[i]:
            k = data.draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:k]
        else:
            lines.insert(i, data.draw(st.sampled_from(TOKENS)))
        if not lines:
            lines = [""]
    return "\n".join(lines)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzz_mutated_specs(data):
    base = data.draw(st.sampled_from([OK] + [open(os.path.join(compll.SPEC_DIR, s + ".cll")).read()
                                             for s in compll.shipped_specs()]))
    fuzz_check(mutate(base, data))


def test_fuzz_deep_nesting_is_an_error_not_a_crash():
    for src in ["float x = " + "(" * 5000 + "1" + ")" * 5000 + ";", "float x = " + "-" * 5000 + "1;",
                "float f(float a) { " + "if (a) " * 3000 + "return a; }"]:
        assert fuzz_check(src) is False


def test_fuzz_a_handful_compile():
    """Mutations that still type-check also compile (-Wall -Wextra -Werror) and run."""
    import random
    import torch
    from hipress import compression as C
    rng = random.Random(1)
    variants = [OK.replace("x > tau ? 1", "x >= tau * 2.0 ? 1"), OK.replace("0.1", "0.25"),
                OK.replace("return c == 1 ? tau", "return c != 1 ? -tau * 0.5 + 1.0 : tau; return c == 1 ? tau")]
    compiled = 0
    for k, v in enumerate(variants):
        try:
            check(v, "v.cll")
        except DSLError:
            continue
        compll.load(f"v{k}.cll", source=v, name=f"fuzzv{k}_{rng.randrange(1 << 30)}")
        compiled += 1
    assert compiled >= 2


STATEFUL = """param P { float m = 0.5; }
state float* u;
state int32 step;
float f(float a, float g) { return a + g; }
float big(float x) { return abs(x) > 0.1; }
void encode(float* gradient, uint8* compressed, P params) {
    u = map(u, gradient, f);
    step += 1;
    float* s = sort(u, greaterAbs, 2);
    u = scatter(u, s.index, 0);
    compressed = concat(s.index, s);
}
void decode(uint8* compressed, float* gradient) {
    extract(compressed, i, v);
    gradient = scatter(i, v);
}
"""


def test_stateful_spec_checks():
    s = check(STATEFUL, "t.cll")
    assert [g.name for g in s.state_arrays] == ["u"] and [(g.name, g.slot) for g in s.state_scalars] == [("step", 1)]


STATE_MISUSE = {  # edit anchor -> [(replacement, line, col, message)]
    'state float* u;': [
        ('state float* u = 1;', 2, 18, 'cannot have an initial value'),
        ('state int32* u;', 2, 7, 'a state array holds floats'),
    ],
    'state int32 step;': [
        ('state float step;', 3, 7, "state is 'state float* name;'"),
        ('state int32 step, a, b, c;', 3, 25, 'at most 3 state scalars'),
    ],
    '    u = scatter(u, s.index, 0);': [
        ('    u = sort(u, greaterAbs, 2);', 10, 9, 'updated in place'),
        ('    float* w = map(u, big); u = scatter(w, s.index, 0);', 10, 33, 'updates its array in place'),
    ],
    '    gradient = scatter(i, v);': [
        ('    step = 2; gradient = scatter(i, v);', 15, 5, 'updated in encode only'),
        ('    float z = step; gradient = scatter(i, v);', 15, 15, 'decode cannot use the state'),
        ('    float z = has_state; gradient = scatter(i, v);', 15, 15, 'available in encode only'),
    ],
    'float f(float a, float g) { return a + g; }': [
        ('float f(float a, float g) { step = 1; return a + g; }', 4, 29, 'updated in encode only'),
    ],
    'param P { float m = 0.5; }': [
        ('param P { float m = 0.5; }\nfloat capacity(int32 n, P p) { return n; }', 2, 1,
         'int32 capacity(int32 n, Params params)'),
        ('param P { float m = 0.5; }\nint32 capacity(int32 n, P p) { return step; }', 2, 39,
         'capacity cannot read the global'),
    ],
    '    step += 1;': [
        ('    step += 1.0 + double(1);\n    float* q = map(u, u, nosuch);', 9, 26, 'user-defined function'),
    ],
}


def test_double_in_header_rejected():
    e = err("param P { double r = 0.5; }\nvoid encode(float* g, uint8* c, P p) { c = concat(p.r); }")
    assert (e.line, e.col) == (2, 53) and "not a double" in e.message


LOWRANK = """param P { int32 rank = 2 in [1, 64]; }
view rows, cols, r = min(rank, min(rows, cols));
state float[rows][cols] m;
state float[cols][r] q;
state float[rows][r] p;
float add(float a, float b) { return a + b; }
void encode(float* gradient, uint8* compressed, P params) {
    m = map(m, gradient, add);
    p = matmul(m, q);
    p = decomp(p);
    float* Q = matmul(m.T, p);
    m -= matmul(p, Q.T);
    compressed = concat(p, Q);
}
void decode(uint8* compressed, float* gradient) {
    extract(compressed, A, B);
    gradient = matmul(A, B.T);
}
void encode_round0(float* gradient, uint8* compressed, P params) {
    float* X = matmul(gradient, q);
    compressed = concat(X);
}
void encode_round1(uint8* sum, uint8* compressed, P params) {
    extract(sum, p);
    float* Q = matmul(m.T, p);
    compressed = concat(Q);
}
void finish(uint8* sum, float* gradient, P params) {
    extract(sum, q);
    gradient = matmul(p, q.T);
}
"""


def test_lowrank_spec_checks():
    s = check(LOWRANK, "t.cll")
    assert [g.name for g in s.state_arrays] == ["m", "q", "p"] and [f.name for f in s.rounds] == \
        ["encode_round0", "encode_round1"] and s.finish is not None and (s.view.rows, s.view.cols, s.view.rank) == \
        ("rows", "cols", "r")


LOWRANK_MISUSE = {  # edit anchor -> [(replacement, line, col, message)]
    'p = matmul(m, q);': [
        ('p = matmul(q, m);', 9, 9, 'inner dimensions differ (cols x r times rows x cols)'),
        ('p = matmul(m.T, q.T);', 9, 9, 'matmul(A.T, B.T) is not supported'),
        ('q = matmul(m, q);', 9, 9, 'is float[cols][r]; this array is float[rows][r]'),
        ('p = matmul(m, q, q);', 9, 9, 'matmul(A, B) multiplies two matrices'),
        ('p = matmul(m, 2);', 9, 19, 'matmul takes float matrices'),
    ],
    'p = decomp(p);': [
        ('p = decomp(p.T);', 10, 18, 'not a transpose'),
    ],
    'm -= matmul(p, Q.T);': [
        ('m -= p;', 12, 10, 'is updated in place'),
        ('p -= matmul(p, Q.T);', 12, 10, 'needs a product of its shape'),
        ('float* z = Q.T;', 12, 18, 'only allowed on an argument of matmul'),
    ],
    'state float[cols][r] q;': [
        ('state float[cols][rank] q;', 4, 19, "'rank' is not a dimension of the view"),
        ('state float[cols] q;', 4, 7, 'two dimensions'),
        ('state int32[cols][r] q;', 4, 7, 'a state matrix holds floats'),
    ],
    'view rows, cols, r = min(rank, min(rows, cols));': [
        ('view rows, cols, r = min(rank, 1.5);', 2, 32, 'the rank is an integer expression'),
        ('view rows, cols, r = min(rank, n);', 2, 32, "'n' in the rank is not a parameter"),
        ('view rows, cols, rank = 2;', 2, 1, "'rank' is a parameter"),
        ('view rows, cols r = 2;', 2, 17, "expected ','"),
    ],
    '    extract(sum, p);\n': [
        ('', 23, 1, 'must read the sum of round 0'),
    ],
    '    extract(sum, p);': [
        ('    extract(sum, q);', 24, 18, "'q' is float[cols][r] but the concat of encode_round0 has float[rows][r]"),
        ('    extract(sum, p);\n    float z = sum;', 25, 15, 'read it with extract(sum, ...)'),
    ],
    '    extract(sum, q);': [
        ('    extract(sum, q, q);', 29, 5, 'extract names 2 values, the concat of encode_round1 has 1'),
    ],
    '    extract(compressed, A, B);': [
        ('    extract(compressed, p, B);', 16, 25, "decode cannot use the state 'p'"),
    ],
    'void encode_round1(': [
        ('void encode_round2(', 23, 1, "'encode_round1' is missing"),
    ],
    'void finish(uint8* sum, float* gradient, P params) {\n    extract(sum, q);\n    gradient = matmul(p, q.T);\n}\n': [
        ('', 23, 1, "needs 'void finish(uint8* sum, float* gradient, Params params)'"),
    ],
    '    compressed = concat(Q);': [
        ('    compressed = concat(Q, 1.0);', 26, 28, 'float matrices only'),
    ],
    '    float* X = matmul(gradient, q);': [
        ('    float* X = matmul(sum, q);', 20, 23, 'matmul takes float matrices'),
    ],
    '    gradient = matmul(A, B.T);': [
        ('    gradient = matmul(A, A.T);', 17, 16,
         "must be a float array of the gradient's size, got float[rows][rows]"),
    ],
    '    gradient = matmul(p, q.T);': [
        ('    gradient = matmul(q, p.T);', 30, 16, "float array of the gradient's size, got float[cols][rows]"),
    ],
    'float add(float a, float b) { return a + b; }': [
        ('float add(float a, float b) { return a + rows; }', 6, 42, 'known in the entry points only'),
    ],
}


def edits(base, table):
    return [(base, old, *r) for old, rows in table.items() for r in rows]


@pytest.mark.parametrize("base,old,new,line,col,msg",
                         edits("STATEFUL", STATE_MISUSE) + edits("LOWRANK", LOWRANK_MISUSE))
def test_misuse_errors(base, old, new, line, col, msg):
    """One edit (old -> new) of a valid spec: the error names the place and the rule broken."""
    src = globals()[base]
    assert old in src
    e = err(src.replace(old, new, 1))
    assert msg in e.message, str(e)
    assert (e.line, e.col) == (line, col), str(e)
    assert str(e).startswith(f"t.cll:{line}:{col}: error: ")


def test_no_view_no_matmul():
    e = err("void encode(float* g, uint8* c) { float* x = matmul(g, g); c = concat(x); }")
    assert (e.line, e.col) == (1, 46) and "needs the matrix view" in e.message
    e = err("void encode(float* g, uint8* c) { float* x = decomp(g); c = concat(x); }")
    assert "needs the matrix view" in e.message
    e = err("void encode(float* g, uint8* c) { c = concat(1); }\nvoid finish(uint8* s, float* g) { extract(s, a); }")
    assert (e.line, e.col) == (2, 1) and "need the matrix view" in e.message


@pytest.mark.parametrize("decl,col,msg", [
    ("float a = 0.5 in 0, 1;", 28, "expected '(' or '['"),
    ("float a = 0.5 in (0 1];", 31, "expected ','"),
    ("float a = 0.5 in (0, 1;", 33, "expected ')' or ']'"),
    ("float a = 0.5 in (x, 1];", 29, "expected a number (or inf)"),
    ("float a = 0.5 in (inf, 1];", 28, "lower bound of a range is a number or -inf"),
    ("float a = 0.5 in (0, -inf];", 28, "upper bound of a range is a number or inf"),
    ("float a = 2 in (0, 1];", 21, "outside its range (0, 1]"),
    ("float a = 1 in (1, 1];", 26, "is empty"),
    ("int32 a = 1 in [2, 1];", 26, "is empty"),
])
def test_param_range_errors(decl, col, msg):
    e = err("param P { " + decl + " }\nvoid encode(float* g, uint8* c, P p) { c = concat(p.a); }")
    assert (e.line, e.col) == (1, col), str(e)
    assert msg in e.message, str(e)


def test_builtins_generate_without_torch_or_core(tmp_path):
    """setup.py generates the built-ins before hipress._C exists and without torch: the generator modules
    must import neither (loaded here as setup.py loads them, under a stand-in 'hipress' package)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, types, importlib\nstub = types.ModuleType('hipress')\n"
            f"stub.__path__ = [{os.path.join(root, 'hipress')!r}]\nsys.modules['hipress'] = stub\n"
            f"paths = importlib.import_module('hipress.dsl.target_module').generate_builtins({str(tmp_path)!r})\n"
            "assert 'torch' not in sys.modules and 'hipress._C' not in sys.modules, sorted(sys.modules)\n"
            "print(len(paths))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    specs = [f for f in os.listdir(os.path.join(root, "hipress", "dsl", "specs")) if f.endswith(".cll")]
    assert out.stdout.strip() == str(len(specs))  # one per shipped spec (the six HiPress ones and GRACE's)
    text = (tmp_path / "builtin_tbq.cc").read_text()
    assert 'HIPRESS_REGISTER_COMPRESSOR("tbq", Builtin);' in text and "hpc_" not in text
    assert "namespace hipress::compress::builtin_tbq {" in text


def test_scaled_signs_idiom_is_onebit_shape_only():
    """Error feedback's fused encode (ops::feedback_scaled_signs) is generated for a spec of onebit's
    exact shape, and not where any part of it differs (another decode sign, a scale other than the
    root mean square or of the sum of squares, the bit of the other sign)."""
    from hipress.dsl.idioms import scaled_signs
    from hipress.dsl.target_module import generate_module
    src, path = compll.read("onebit")
    assert scaled_signs(check(src, path)).row_slot == 1
    assert "ops::feedback_scaled_signs" in generate_module(check(src, path))
    for old, new in [("b ? -scale : scale", "b ? scale : -scale"), ("return sqrt(m);", "return m;"),
                     ("return x * x;", "return x * abs(x);"), ("signbit(x)", "!signbit(x)")]:
        other = src.replace(old, new)
        assert other != src, old
        spec = check(other, path)
        assert scaled_signs(spec) is None, new
        assert "feedback_scaled_signs" not in generate_module(spec)
    for name in ("tbq", "terngrad", "efsignsgd", "signsgd", "dgc"):
        assert scaled_signs(check(*compll.read(name))) is None, name


def test_per_element_logic_has_no_branch_unless_it_draws():
    """In a user function (run per element) `a || b` and `a && b` are emitted as `|` and `&` on the two
    truth values: a loop over the predicate then vectorises. Where the right side draws a random number
    the short circuit stays (a draw is work the branch skips)."""
    src, path = compll.read("tbq")
    code = compll.generate(path, source=src)
    assert "((a_x) > (c.g_tau))) != 0) | ((" in code and ") || (" not in code
    drawn = src.replace("uint2 ternarize(float x) { return x > tau ? 1 : (x < -tau ? 2 : 0); }",
                        "uint2 ternarize(float x) { return x > tau || random<float>(0, 1) < 0.5 ? 1 : 0; }")
    assert drawn != src
    assert ") || (" in compll.generate(path, source=drawn)


def test_stateless_encode_allocates_a_zero_state_only_when_it_can_read_it():
    """DGC touches its state only under `if (has_state)`: a stateless encode (CaSync-PS's
    aggregator re-encode) must not allocate and clear 2n floats of scratch state (that made
    it 6x slower than the hand-written kernel). A spec that reads state outside the guard
    still gets the zero state."""
    src, path = compll.read("dgc")
    guarded = compll.generate(path, source=src)
    assert "st_tmp.assign" not in guarded and "c.g_accum.p = nullptr" in guarded
    unguarded_src = src.replace("S = sort(gradient, greaterAbs, topk_count(density, n), samples);",
                                "S = sort(accum, greaterAbs, topk_count(density, n), samples);")
    assert unguarded_src != src
    assert "st_tmp.assign" in compll.generate(path, source=unguarded_src)
