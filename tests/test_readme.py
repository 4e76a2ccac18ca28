"""The README and the tutorial run as printed: every ```bash and ```python block, in order, in a
fresh folder, as a user following them would (examples/ beside it, the venv's `python` and
`aviatorc` first on PATH).

A block that cannot run here (an install from the network, the whole test suite) carries
`<!-- no-test: reason -->` on the line before it; there are few, and each names its reason.
The README runs after its own user install (tests/test_install.py), the tutorial here, with the
development environment. The `serve` blocks run as printed except for their port: a free one instead of 8000, so two test
runs (or a server someone left running) do not collide.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "examples/tutorial.md")
FENCE = re.compile(r"^```(\w*)\s*$")
NO_TEST = re.compile(r"^<!--\s*no-test:\s*(.*?)\s*-->$")
BLOCK_TIMEOUT_S = 300  # the slowest block (planning Llama-3-8B twice) takes about a minute on 2 loaded cores


@dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown file."""

    path: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    no_test: str | None  # the reason, when the block is marked not to run

    def where(self) -> str:
        return f"{self.path}:{self.line} ({self.language} block)"


def blocks(path: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of `path` (or of `text`, read as that file), in order."""
    lines = (text if text is not None else (ROOT / path).read_text()).splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NO_TEST.match(before)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{path}:{i + 1}: a code block that is never closed")
        out.append(Block(path, i + 1, opening.group(1), "\n".join(lines[i + 1:end]) + "\n",
                         marker.group(1) if marker else None))
        i = end + 1
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_block(block: Block, folder: Path, env: dict[str, str], timeout_s: float = BLOCK_TIMEOUT_S) -> str:
    """Run one block in `folder`; its output, or an AssertionError naming the block."""
    code = block.code
    if "aviatorc serve" in code:
        code = code.replace("8000", str(free_port()))
    # The `python` first on the block's PATH (the user install's, in tests/test_install.py).
    python = shutil.which("python", path=env.get("PATH")) or sys.executable
    command = ["bash", "-euo", "pipefail", "-c", code] if block.language == "bash" else [python, "-c", code]
    # A session of its own, so whatever the block starts in the background (a server) is ended
    # with it, even when the block fails before its own `kill`.
    proc = subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{block.where()} ran past {timeout_s} s:\n{output[-3000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.returncode != 0:
        raise AssertionError(f"{block.where()} exited {proc.returncode}:\n{code}\n--- output ---\n{output[-3000:]}")
    return output


def run_document(path: str, folder: Path) -> dict[int, str]:
    """Run every block of `path` that is not marked no-test, in order, in `folder`; output by line."""
    shutil.copytree(ROOT / "examples", folder / "examples", ignore=shutil.ignore_patterns("build", "__pycache__"))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONUNBUFFERED="1")
    return {b.line: run_block(b, folder, env) for b in blocks(path) if b.no_test is None}


# -- the markers -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCUMENTS)
def test_every_block_runs_or_says_why_not(path: str) -> None:
    found = blocks(path)
    assert found, f"{path} has no code blocks"
    for b in found:
        assert b.language in ("bash", "python") or b.no_test, (
            f"{b.where()}: only bash and python blocks run; mark it `<!-- no-test: reason -->` or give it a language")
        assert b.no_test is None or b.no_test.strip(), f"{b.where()}: a no-test marker needs a reason"
    skipped = [b for b in found if b.no_test]
    assert len(skipped) <= 3, f"{path}: {len(skipped)} blocks are marked no-test: " + ", ".join(
        b.where() for b in skipped)


def test_block_parser_reads_markers_and_languages() -> None:
    text = "intro\n\n<!-- no-test: downloads -->\n```bash\npip install x\n```\n\n```python\nprint(1)\n```\n"
    first, second = blocks("X.md", text)
    assert (first.line, first.language, first.code, first.no_test) == (4, "bash", "pip install x\n", "downloads")
    assert (second.language, second.code, second.no_test) == ("python", "print(1)\n", None)
    with pytest.raises(AssertionError, match="never closed"):
        blocks("X.md", "```bash\nls\n")


def test_failing_block_names_its_place(tmp_path: Path) -> None:
    bad = Block("X.md", 7, "bash", "echo before\nfalse\necho after\n", None)
    with pytest.raises(AssertionError, match=r"X\.md:7 \(bash block\) exited 1"):
        run_block(bad, tmp_path, dict(os.environ))


def test_ci_installs_as_the_readme_says() -> None:
    """CI's install is the README's developer install, line for line."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("pip install") and "--upgrade pip" not in line]
    dev = next(b for b in blocks("README.md") if "-e '.[test]'" in b.code)
    readme = [line.split("#")[0].strip() for line in dev.code.splitlines() if line.strip()]
    assert ci == readme, f".ci/run installs {ci}, the README says {readme}"


# -- running them ------------------------------------------------------------------------------


# The README itself runs in tests/test_install.py: after its own user install, in a fresh virtual
# environment, so a documented command that needs a package the install does not bring fails.


def test_tutorial_runs(tmp_path: Path) -> None:
    outputs = run_document("examples/tutorial.md", tmp_path)
    assert any("max abs difference" in text for text in outputs.values()), "the tutorial's comparison did not print"
    assert (tmp_path / "out" / "tutorial" / "gpt2.avc" / "report.html").exists(), "compile wrote no report.html"
    assert (tmp_path / "out" / "tutorial" / "report.html").stat().st_size > 0


def test_shipped_llama3_8b_config_is_the_real_one() -> None:
    """examples/llama3-8b/config.json, the README's real-size model, has Llama-3-8B's shape."""
    from aviatorc.models import llama_config

    shipped = json.loads((ROOT / "examples" / "llama3-8b" / "config.json").read_text())
    known = llama_config("llama-3-8b")
    size = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings", "model_type")
    assert {k: shipped.get(k) for k in size} == {k: known[k] for k in size}
