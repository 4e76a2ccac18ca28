"""The README's user install, in a fresh virtual environment, runs the README as written.

A copy of the repository's tracked files (a fresh clone, without this checkout's build folders)
is installed the README's user way, the `pip install '.[...]'` line of its Install block, into a
new virtual environment; torch first, pinned, from the machine's wheel cache or package index
(the README's line names PyTorch's CPU index, which is not a package registry this machine
reaches: the same pinned CPU build comes from the local cache). Then every runnable block of the
README (Quickstart, GGUF, serving) runs in the checkout's root, with that environment's `python`
and `aviatorc` first on PATH, as `tests/test_readme.py` runs them: a documented command that needs
a package the install does not bring fails here, and so does Python run in the checkout, whose
aviatorc/ folder comes before the installed package there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import ROOT, blocks, run_block

INSTALL_TIMEOUT_S = 1500
# The GGUF block compiles SmolLM2-135M and runs it three times (generate, chat, serve). Its 20
# minutes date from a first run that computed as it checked (now a walk, then the tape) and a GGUF
# load that parsed the file twice (now once); not yet measured again since, so not lowered yet.
GGUF_BLOCK_TIMEOUT_S = 1200
TORCH = "torch==2.13.0"  # the pin of .ci/run


def user_install_line() -> str:
    """The README's user install: the `pip install '.[...]'` line of the first Install block."""
    first = blocks("README.md")[0]
    line = next(line.split("#")[0].strip() for line in first.code.splitlines() if re.match(r"pip install '?\.", line))
    return line


def tracked_copy(folder: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return folder


@pytest.mark.slow
def test_readme_runs_after_the_user_install(tmp_path: Path) -> None:
    checkout = tracked_copy(tmp_path / "aviatorc")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    pip = [str(bin_dir / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True, env=env, timeout=INSTALL_TIMEOUT_S)
    line = user_install_line()
    assert line.startswith("pip install '.[") and "serve" in line and "gguf" in line and "examples" in line, line
    done = subprocess.run(["bash", "-c", line.replace("pip install", f"{bin_dir / 'python'} -m pip install --quiet", 1)],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    # Installed, not imported from a checkout: the package lives in the new environment.
    where = subprocess.run([str(bin_dir / "python"), "-c", "import aviatorc; print(aviatorc.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where

    # In the checkout's root, where the user installed it: its aviatorc/ folder comes first on
    # `python -c`'s path there, beside the installed package.
    work = checkout
    env["PYTHONUNBUFFERED"] = "1"
    outputs = {b.line: run_block(b, work, env, timeout_s=GGUF_BLOCK_TIMEOUT_S) for b in blocks("README.md")
               if b.no_test is None}
    joined = "\n".join(outputs.values())
    assert '"choices"' in joined and (work / "out" / "smollm2.avc" / "plan.json").exists()
    assert (work / "out" / "l3-8b.avc" / "plan.json").exists()  # the real-size plan was written
    assert "Paris" in joined  # the INT4 GGUF plan's greedy answer, through generate --prompt
    assert "timing: measured here" in joined  # generate's measured-beside-predicted line
