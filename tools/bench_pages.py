"""What the benchmark scripts share for their results pages: each run saves its figures as
`tools/results/<name>.json`, and the page `<name>.md` is rendered from that JSON alone, so a
page holds nothing its script did not write (`tests/tools/test_bench_pages.py` checks it).
The JSON a run replaces is kept inside the new one as `previous`, one run back, for the
page's before-and-after comparison.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _describe_tree() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"commit {commit}" + (" with uncommitted changes" if dirty else "")


_AT_START = _describe_tree()  # the scripts import this module first: the tree their run started from


def describe_run() -> str:
    """Which code produced the figures: the commit, and whether the tree had uncommitted changes,
    as they were when the script started (a run takes minutes; the tree may move under it)."""
    return _AT_START


def previous_run(saved: Path) -> dict[str, Any] | None:
    """The figures this run replaces (without their own `previous`: one run back, not the history)."""
    if not saved.exists():
        return None
    data = json.loads(saved.read_text())
    data.pop("previous", None)
    return data


def write_results(page: Path, data: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> None:
    """Save `data` beside `page` as JSON and write `page` rendered from it."""
    page.parent.mkdir(parents=True, exist_ok=True)
    page.with_suffix(".json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    page.write_text(render(data))
    print(f"wrote {page} and {page.with_suffix('.json')}")


def rerender(page: Path, render: Callable[[dict[str, Any]], str]) -> None:
    """Rewrite `page` from its saved JSON; nothing is measured."""
    page.write_text(render(json.loads(page.with_suffix(".json").read_text())))
    print(f"wrote {page} from {page.with_suffix('.json')}")


def bench_main(page: Path, measure: Callable[[], dict[str, Any]], render: Callable[[dict[str, Any]], str],
               description: str) -> None:
    """A bench's command line: measure and write `page` and its JSON, or with --render rewrite the page."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--render", action="store_true", help="rewrite the page from the saved JSON; measure nothing")
    if parser.parse_args().render:
        rerender(page, render)
    else:
        write_results(page, measure(), render)
