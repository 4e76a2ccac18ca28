"""A report opened in headless Chromium, offline: what the browser test and `tools/bench_report.py` share.

    with offline_page(Path("build/model.avc/report.html"), chromium="/usr/bin/chromium") as opened:
        opened.page.locator("section#placement h2").inner_text()
    opened.problems            # console errors, page errors and any request for another URL

Every request but the file itself is refused and counted as a problem: the page must need
nothing from the network. Drives the system Chromium through playwright (a test dependency).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class OpenedPage:
    page: Any  # playwright.sync_api.Page
    problems: list[str] = field(default_factory=list)

    def wait_for_charts(self, timeout_ms: int = 60_000) -> int:
        """Wait until the page says every chart is drawn (body[data-charts]); how many it drew."""
        self.page.wait_for_function("document.body.dataset.charts !== undefined", timeout=timeout_ms)
        return int(self.page.evaluate("document.body.dataset.charts"))


@contextmanager
def offline_page(path: Path, chromium: str, *, width: int = 1400, height: int = 900) -> Iterator[OpenedPage]:
    """`path` loaded (to its load event) in a fresh headless browser with the network refused."""
    from playwright.sync_api import sync_playwright

    url = path.resolve().as_uri()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            opened = OpenedPage(context.new_page())

            def only_the_file(route: Any) -> None:
                if route.request.url == url:
                    route.continue_()
                else:
                    opened.problems.append(f"fetched {route.request.url}")
                    route.abort()

            context.route("**/*", only_the_file)
            opened.page.on("console", lambda message: opened.problems.append(message.text)
                            if message.type == "error" else None)
            opened.page.on("pageerror", lambda error: opened.problems.append(str(error)))
            opened.page.goto(url, wait_until="load")
            yield opened
        finally:
            browser.close()
