"""Does a torch C++ extension built on this machine share the process's libstdc++?

Why: DeepGEMM's module segfaulted on the GPU machine in its first call, inside
std::regex and then inside `ostream << unsigned long`. The cause was not DeepGEMM: an extension
linked there the default way carries its own static copy of libstdc++, whose locale facet ids
disagree with the shared library's, so its first facet call goes through another facet's vtable.
This builds a ten-line extension (a std::regex with bracket expressions and a hex stringstream,
what crashed) once per link mode, each in a child process so that a crash is a result, and
records whether the module depends on libstdc++.so and whether the call survives.

    python3 bench/fp8/libstdcxx_probe.py --out $OUT/libstdcxx_probe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench.results
from bench.results import write_result  # noqa: E402

SOURCE = r"""
#include <regex>
#include <sstream>
#include <string>
std::string probe(const std::string& s) {
  std::regex include(R"(#\s*include\s*[<"][^>"]+[>"])");
  std::string out;
  for (std::sregex_iterator it(s.begin(), s.end(), include), end; it != end; ++it) out += it->str() + ";";
  std::stringstream hex;
  hex << std::hex << 255ul;
  return out + hex.str();
}
"""
WANT = '#include <a>;# include "b.h";ff'
# The link modes compared: the default, and the shared library named explicitly (deepgemm.py's).
MODES = {"default": [], "shared_libstdcxx": ["-l:libstdc++.so.6"]}

CHILD = """
import json, subprocess, sys
from torch.utils.cpp_extension import load_inline
name, build, flags = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
m = load_inline(name, cpp_sources=[sys.stdin.read()], functions=["probe"], extra_ldflags=flags, build_directory=build)
ldd = subprocess.run(["ldd", m.__file__], capture_output=True, text=True).stdout
print(json.dumps({"links_libstdcxx_so": "libstdc++.so" in ldd}), flush=True)
print(json.dumps({"result": m.probe('#include <a>\\n# include "b.h"')}), flush=True)
"""


def run_mode(name: str, flags: list[str], build: Path) -> dict[str, object]:
    build.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, f"libstdcxx_probe_{name}", str(build), json.dumps(flags)],
        input=SOURCE,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    row: dict[str, object] = {"ldflags": flags, "returncode": proc.returncode}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row.update(json.loads(line))
    row["ok"] = proc.returncode == 0 and row.get("result") == WANT
    if proc.returncode != 0:
        row["stderr_tail"] = proc.stderr[-2000:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: run_mode(name, flags, Path(tmp) / name) for name, flags in MODES.items()}
    report = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": platform.node(),
        "baseline": "the default link, in the same run",
        "modes": rows,
    }
    write_result(args.out, report)
    for name, row in rows.items():
        print(
            f"{name:18s} returncode {row['returncode']:4d}  libstdc++.so linked: {row.get('links_libstdcxx_so')}  ok: {row['ok']}"
        )


if __name__ == "__main__":
    main()
