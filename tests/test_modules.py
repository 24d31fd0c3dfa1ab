"""Every module of yeto_patch imports on this Python (no syntax or import the other supported Python lacks), and
the layers stay one-way: wire imports nothing else of ours, syncer only wire, island only wire, hooks only island
(and wire, config)."""
import ast
import importlib
import os
import pkgutil

import pytest

import yeto_patch

PKG = os.path.dirname(yeto_patch.__file__)
# what each layer may import of ours (beyond itself); the top-level modules (config, cli) are shared settings
ALLOWED = {
    "wire": set(),
    "syncer": {"wire"},
    "island": {"wire", "config"},
    "hooks": {"island", "wire", "config"},
}
OPTIONAL = {"yeto_patch.demo.plot": "matplotlib",   # the 'plot' extra
            "yeto_patch.wire.codec_jit_kernels": "numba"}   # the fused codecs (pinned; the numpy kernels without)


def _modules():
    return sorted(m.name for m in pkgutil.walk_packages([PKG], "yeto_patch.") if not m.name.endswith(".__main__"))


@pytest.mark.parametrize("name", _modules())
def test_module_imports(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    importlib.import_module(name)


def _our_imports(path: str, package: str) -> set:
    """The yeto_patch subpackages (or top-level modules) that the file at `path` imports."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:   # relative: resolve against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            parts = n.split(".")
            if parts[0] == "yeto_patch" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_are_one_way(layer):
    root = os.path.join(PKG, layer)
    bad = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                package = "yeto_patch." + os.path.relpath(dirpath, PKG).replace(os.sep, ".")
                extra = _our_imports(path, package) - ALLOWED[layer] - {layer}
                # a module named like a subpackage file (e.g. `from . import auth`) resolves inside the layer
                extra = {e for e in extra if not os.path.exists(os.path.join(root, e + ".py"))}
                if extra:
                    bad.append(f"{os.path.relpath(path, PKG)} imports {sorted(extra)}")
    assert not bad, bad


def test_the_import_reader_sees_relative_and_absolute_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from ..wire import frames\nfrom . import rounds\nimport yeto_patch.island.masters.names\n"
                 "from yeto_patch import hooks\n")
    assert _our_imports(str(f), "yeto_patch.syncer") == {"wire", "syncer", "island", "hooks"}
