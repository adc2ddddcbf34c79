#!/usr/bin/env python3
"""Fails when a header of include/partir includes one of a later layer (shared/DESIGN.md, "Wave 3").

Layers, lowest first; a header may include its own layer and the ones before it. sim/ and runtime/ are siblings
above spmd/: neither reads the other (what both need is computed once, in spmd/). Usage: check_layers.py [root]
"""
import pathlib
import re
import sys

LAYERS = [
    ["config.hpp", "error.hpp"],
    ["ir/"],
    ["mesh.hpp"],
    ["dsl/"],
    ["autodiff/"],
    ["sharding/"],
    ["tactics/"],
    ["viz/"],
    ["spmd/"],
    ["sim/"],
    ["runtime/kernels/"],
    ["runtime/comm/", "runtime/exec/", "runtime/state/", "runtime/gpu/"],
    ["search/"],
    ["calibrate/"],
    ["partir.hpp"],
]
SIBLINGS = [("runtime/", "sim/")]  # (includer, included) pairs that the order alone would allow


def layer(path):
    for i, prefixes in enumerate(LAYERS):
        if any(path == p or (p.endswith("/") and path.startswith(p)) for p in prefixes):
            return i
    return None


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent) / "include/partir"
    errors = []
    for header in sorted(root.rglob("*.hpp")) + sorted(root.rglob("*.cuh")):
        name = header.relative_to(root).as_posix()
        mine = layer(name)
        if mine is None:
            errors.append(f"{name}: in no layer of tools/check_layers.py (add its folder to LAYERS)")
            continue
        for number, line in enumerate(header.read_text().splitlines(), 1):
            m = re.match(r'\s*#\s*include\s*[<"]partir/([^">]+)[">]', line)
            if not m:
                continue
            target = m.group(1)
            theirs = layer(target)
            if theirs is None:
                errors.append(f"{name}:{number}: includes partir/{target}, which is in no layer")
            elif theirs > mine:
                errors.append(f"{name}:{number}: includes partir/{target}, a later layer ({LAYERS[theirs][0]} above "
                              f"{LAYERS[mine][0]})")
            elif any(name.startswith(a) and target.startswith(b) for a, b in SIBLINGS):
                errors.append(f"{name}:{number}: includes partir/{target}: {name.split('/')[0]}/ does not read "
                              f"{target.split('/')[0]}/")
    for e in errors:
        print(e)
    print(f"check_layers: {'FAILED, ' + str(len(errors)) + ' includes' if errors else 'every include points down'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
