"""The seams hold: checked on the imports of the package's source (ast, not text search).

* only hipress/comm/ imports a transport backend (strategies, the optimizer, the planner
  and the benches reach transports through the registry, the world or an Exchange);
* hipress/sync/ imports nothing of hipress.comm.transport (it sees an Exchange);
* no module of hipress imports the Horovod adapter (horovod_ext joins by entry point).
"""
import ast
import pathlib

import hipress

PKG = pathlib.Path(hipress.__file__).parent
BACKENDS = {f"hipress.comm.transport.{m}" for m in ("loopback", "mpi", "torch_dist", "nccl")}


def imports_of(path: pathlib.Path):
    """Every module name an import statement of ``path`` names (``from a import b``
    counts as both ``a`` and ``a.b``)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            for a in node.names:
                yield f"{node.module}.{a.name}"


def modules(under: pathlib.Path):
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def test_scan_sees_the_package():
    files = modules(PKG)
    assert len(files) > 40
    # the scanner finds what is there: the comm wing does import its backends
    comm_imports = {name for p in modules(PKG / "comm") for name in imports_of(p)}
    assert BACKENDS & comm_imports


def test_only_comm_imports_transport_backends():
    bad = [(str(p.relative_to(PKG)), name) for p in modules(PKG) if "comm" not in p.relative_to(PKG).parts[:1]
           for name in imports_of(p) if name in BACKENDS or any(name.startswith(b + ".") for b in BACKENDS)]
    assert bad == []


def test_sync_sees_no_transport():
    bad = [(str(p.relative_to(PKG)), name) for p in modules(PKG / "sync") for name in imports_of(p)
           if name.startswith("hipress.comm.transport") or name == "hipress.comm.world"]
    assert bad == []


def test_core_never_imports_the_horovod_adapter():
    bad = [(str(p.relative_to(PKG)), name) for p in modules(PKG) for name in imports_of(p)
           if name == "horovod_ext" or name.startswith("horovod_ext.")]
    assert bad == []


def test_every_source_folder_is_a_regular_package():
    """setup.py's find_packages ships only folders with an __init__.py: a folder of modules
    without one would work in an editable install and be missing from a wheel."""
    missing = sorted(str(d.relative_to(PKG)) for d in {p.parent for p in modules(PKG)}
                     if not (d / "__init__.py").exists())
    assert missing == []


def test_optuna_is_imported_lazily():
    """bucket_bytes="tune" needs optuna; ``import hipress`` must not: no module imports it at its
    top level (only inside the functions that tune)."""
    bad = []
    for p in modules(PKG):
        tree = ast.parse(p.read_text(), str(p))
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [(str(p.relative_to(PKG)), n) for n in names if n == "optuna" or n.startswith("optuna.")]
    assert bad == []
