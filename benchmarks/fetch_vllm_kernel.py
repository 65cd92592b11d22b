"""Fetch vLLM's Triton expert kernel and its H200 configs for `moe bench kernel` (run once, on a
machine with internet; the folder is ignored by git and carried to the GPU machine).

    python benchmarks/fetch_vllm_kernel.py [--version 0.33.0] [--out benchmarks/vllm_kernel]

Downloads vLLM's wheel (`pip download vllm==VERSION --no-deps`, ~340 MB, kept in OUT/wheel/
until the extraction is done, then deleted) and writes:
    OUT/vllm_fused_moe_kernel.py   `fused_moe_kernel` and `write_zeros_to_output`, cut unchanged
                                   out of vllm/model_executor/layers/fused_moe/fused_moe.py
    OUT/configs/*NVIDIA_H200*.json vLLM's tuned configs for the H200
    OUT/VERSION                    the wheel's file name
moe/bench/vllm_kernel.py loads them; nothing of it is ever committed.
"""
from __future__ import annotations

import argparse
import ast
import glob
import os
import shutil
import subprocess
import sys
import zipfile

SOURCE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
CONFIG_PREFIX = "vllm/model_executor/layers/fused_moe/configs/"
FUNCTIONS = ("write_zeros_to_output", "fused_moe_kernel")
HEADER = '''"""Cut out of vLLM's wheel ({wheel}, {source}) by benchmarks/fetch_vllm_kernel.py;
Apache-2.0, copyright the vLLM project. Not part of moe-runtime; never committed."""
import triton
import triton.language as tl

'''


def extract_functions(source: str, names=FUNCTIONS) -> str:
    """The source text (decorators included) of the top-level functions `names`, in that order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            found[node.name] = "\n".join(lines[start:node.end_lineno])
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{SOURCE} has no top-level function(s) {missing}: this vLLM version is not supported")
    return "\n\n\n".join(found[n] for n in names) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", default="0.33.0", help="vLLM version (default: %(default)s)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_kernel"))
    p.add_argument("--wheel", help="use this already downloaded wheel instead of downloading")
    args = p.parse_args(argv)
    os.makedirs(os.path.join(args.out, "configs"), exist_ok=True)
    wheel = args.wheel
    tmp = os.path.join(args.out, "wheel")
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={args.version}", "--no-deps",
                        "--only-binary=:all:", "-d", tmp], check=True)
        wheel = glob.glob(os.path.join(tmp, "vllm-*.whl"))[0]
    with zipfile.ZipFile(wheel) as z:
        code = extract_functions(z.read(SOURCE).decode())
        header = HEADER.format(wheel=os.path.basename(wheel), source=SOURCE)
        with open(os.path.join(args.out, "vllm_fused_moe_kernel.py"), "w") as f:
            f.write(header + code)
        configs = [n for n in z.namelist() if n.startswith(CONFIG_PREFIX) and "device_name=NVIDIA_H200" in n]
        for name in configs:
            with open(os.path.join(args.out, "configs", os.path.basename(name)), "wb") as f:
                f.write(z.read(name))
    with open(os.path.join(args.out, "VERSION"), "w") as f:
        f.write(os.path.basename(wheel) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.out}: the kernel and {len(configs)} H200 config files from {os.path.basename(wheel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
