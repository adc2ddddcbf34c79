#!/usr/bin/env python3
"""tools/check_layers.py passes on the tree and fails on a header that includes a later layer or a sibling."""
import pathlib
import subprocess
import sys
import tempfile

tool = pathlib.Path(__file__).resolve().parent.parent / "tools/check_layers.py"
root = pathlib.Path(__file__).resolve().parent.parent
assert subprocess.run([sys.executable, tool, root]).returncode == 0, "the tree has an include pointing up"
for includer, included in [("sim/simulator.hpp", "runtime/exec/executor.hpp"), ("spmd/lower.hpp", "sim/report.hpp"),
                           ("runtime/gpu/device.hpp", "sim/hardware_profile.hpp"), ("tactics/presets.hpp", "search/automatic.hpp")]:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in [(includer, f'#include "partir/{included}"\n'), (included, "")]:
            path = pathlib.Path(tmp) / "include/partir" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        got = subprocess.run([sys.executable, tool, tmp], capture_output=True, text=True)
        assert got.returncode == 1 and f"{includer}:1: includes partir/{included}" in got.stdout, got.stdout
print("check_layers: the tree passes; upward and sibling includes fail")
