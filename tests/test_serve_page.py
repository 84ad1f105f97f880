"""The page `cascadia serve` sends at `/`, in headless Chromium (Debian's package, driven by Playwright) against a live
server on the tiny model: it loads with no console error, shows every node of the plan, and a chat message streams
a reply. Skipped where /usr/bin/chromium is not installed (`apt-get install chromium`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from serving import Served

playwright = pytest.importorskip("playwright.sync_api")

SPEC = Path(__file__).parent.parent / "specs" / "tiny-local.yaml"
CHROMIUM = Path(os.environ.get("CASCADIA_CHROMIUM", "/usr/bin/chromium"))
WAIT_MS = 60_000

pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM}")


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    served = Served(tmp_path_factory.mktemp("page"), SPEC, checkpoint)
    yield served
    assert served.stop() == 0


def test_the_page_shows_the_plan_and_streams_a_chat_reply(server, tmp_path):
    problems: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            page.on("console", lambda message: message.type == "error" and problems.append(message.text))
            page.on("pageerror", lambda error: problems.append(str(error)))
            # the page samples at temperature 1 with a random seed, so a reply may stop at its first tokens (about 1
            # in 40 on this checkpoint); greedy, it is the same 39 tokens every time
            page.route("**/v1/chat/completions", lambda route: route.continue_(
                post_data=json.dumps(json.loads(route.request.post_data) | {"temperature": 0})))
            page.goto(server.url, wait_until="load")
            playwright.expect(page.locator("#state")).to_have_text("serving", timeout=WAIT_MS)
            rows = page.locator("#stages tr")
            playwright.expect(rows).to_have_count(3, timeout=WAIT_MS)
            assert [rows.nth(i).get_attribute("data-node") for i in range(3)] == ["node0", "node1", "node2"]
            assert rows.nth(2).locator("td").nth(1).inner_text() == "4-5"
            machine = [rows.nth(0).locator("td").nth(i).inner_text() for i in range(5, 9)]
            assert machine == ["local", "1.00 GiB", "–", "–"]  # tiny-local.yaml gives memory, no speeds

            page.fill("#message", "Hello!")
            page.click("button[type=submit]")
            playwright.expect(page.locator("#log .finish")).to_have_text(re.compile(r"\((length|stop)\)"),
                                                                         timeout=WAIT_MS)
            text = page.locator("#log .reply").inner_text()
            assert text and not text.startswith("error"), text
            playwright.expect(page.locator("#rate")).not_to_have_text("0.0", timeout=WAIT_MS)  # the reply's tokens
            page.screenshot(path=os.environ.get("CASCADIA_PAGE_SHOT", str(tmp_path / "page.png")), full_page=True)
        finally:
            browser.close()
    assert problems == []
