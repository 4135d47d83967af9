"""The console read in a real browser at 1,440 px after a few dozen requests (issue 47, items 14 and 15):
the Requests table leads Submit & fork, the prefix tree's tile labels stay readable and its branches get
the width (no column for the one namespace), and no chart's title shares its toolbar's row.

A retained request forked into fifty children in one action gives the cache fifty branches under one
shared prefix, as fifty requests sharing a system prompt do. Screenshots land in artifacts/.
"""

from __future__ import annotations

import re

import pytest

from tests.browser_support import ARTIFACTS, TIMEOUT_MS, ConsoleServer, launch_page
from tests.test_browser import apply_text, go, shot

SYSTEM = "You are the support bot of Example Corp: answer questions on invoices, refunds and orders briefly. " * 2
NUM_CHILDREN = 50
MIN_LABEL_PX = 10  # the smallest font a tile label may be drawn in
MIN_BRANCH_COLUMN_SHARE = 0.45  # of the figure's width, for the column of the fifty branches

# Every drawn tile label of an icicle: its font size as drawn (CSS size times the text's scale) and its
# tile's box, with the plot's box.
LABELS = """plot => {
    const svg = plot.querySelector('svg.main-svg').getBoundingClientRect();
    const tiles = Array.from(plot.querySelectorAll('g.slice')).map(slice => {
        const text = slice.querySelector('text.slicetext');
        const path = slice.querySelector('path.surface').getBoundingClientRect();
        const shown = text && text.textContent.length > 0 && getComputedStyle(text).display !== 'none'
            && text.getBoundingClientRect().width > 0;
        const size = shown ? parseFloat(getComputedStyle(text).fontSize) * text.getCTM().a : null;
        return {text: text ? text.textContent : '', px: size, left: path.left, width: path.width};
    });
    return {tiles, left: svg.left, width: svg.width};
}"""

# A Plotly figure's title box and its toolbar's box (the toolbar shows while the pointer is over the chart).
TITLE_AND_TOOLBAR = """plot => {
    const title = plot.querySelector('.gtitle');
    const bar = plot.querySelector('.modebar');
    const box = e => { const r = e.getBoundingClientRect(); return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
    return {title: title ? box(title) : null, bar: bar ? box(bar) : null, text: title ? title.textContent : ''};
}"""


@pytest.mark.parametrize("console_server", [512], indirect=True)
def test_the_prefix_tree_of_fifty_requests_and_the_overview_charts_read_at_1440_px(console_server: ConsoleServer) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser, page = launch_page(playwright, expect, height=1000)
        page.set_viewport_size({"width": 1440, "height": 1000})
        main = page.locator("[data-testid='stMain']").first
        try:
            page.goto(console_server.url)
            expect(page.get_by_text("KV usage", exact=True).first).to_be_visible(timeout=4 * TIMEOUT_MS)
            go(page, "Submit & fork")
            # The Requests table leads the page: an operator finds a request without scrolling.
            requests = main.locator(".st-key-submit_requests")
            expect(requests.get_by_role("heading", name="Requests")).to_be_in_viewport()
            apply_text(page, "Submit & fork", "Prompt", SYSTEM, shown=main.get_by_text(re.compile(r"full blocks? of 16")))
            page.get_by_text("Retain as fork base").click()
            page.get_by_role("button", name="Submit", exact=True).click()
            expect(main.get_by_text("req-0 · retained", exact=False).first).to_be_visible()
            suffixes = "\n".join(f" Order {n * 7919 % 10007}: where is my refund, and when does it arrive?" for n in range(NUM_CHILDREN))
            fork = page.get_by_role("button", name=f"Fork children ({NUM_CHILDREN}, not retained)")
            apply_text(page, "Submit & fork", "Suffixes, one child per line", suffixes, shown=fork)
            fork.click()
            expect(main.get_by_text(f"Forked req-0 into {NUM_CHILDREN} children")).to_be_visible()
            expect(requests.get_by_text(f"req-{NUM_CHILDREN}", exact=False).first).to_be_attached()
            requests.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "browser-submit-requests.png"))  # the table, at the top

            go(page, "Prefix tree")
            expect(main.get_by_text(re.compile(rf"drawn as {NUM_CHILDREN + 1}"))).to_be_visible()
            chart = main.locator("[data-testid='stPlotlyChart']").first
            expect(chart.locator("g.slice").first).to_be_attached()
            drawn = chart.locator(".js-plotly-plot").first.evaluate(LABELS)
            shot(page, "browser-prefix-tree-50")
            labelled = [t for t in drawn["tiles"] if t["px"] is not None]
            assert labelled, "no tile label is drawn"
            small = [t for t in labelled if t["px"] < MIN_LABEL_PX - 0.01]
            assert not small, f"{len(small)} of {len(labelled)} labels under {MIN_LABEL_PX} px: {small[:3]}"
            # Two columns, the shared prompt and the branches: no column of its own for the one namespace.
            last_left = max(t["left"] for t in drawn["tiles"])
            branches = [t for t in drawn["tiles"] if abs(t["left"] - last_left) < 1]
            assert len(branches) == NUM_CHILDREN
            assert branches[0]["width"] >= MIN_BRANCH_COLUMN_SHARE * drawn["width"], (branches[0], drawn["width"])

            go(page, "Overview")
            expect(main.get_by_text("KV usage and hit rate")).to_be_visible()
            charts = main.locator("[data-testid='stPlotlyChart']").filter(has=page.locator(".gtitle"))
            expect(charts.first).to_be_visible()
            for index in range(charts.count()):
                chart = charts.nth(index)
                chart.scroll_into_view_if_needed()
                chart.hover()
                plot = chart.locator(".js-plotly-plot").first
                expect(plot.locator(".modebar").first).to_be_visible()
                boxes = plot.evaluate(TITLE_AND_TOOLBAR)
                assert boxes["title"] and boxes["bar"], boxes
                # Below the toolbar's strip, whatever the width: a long title or a narrow column never meets it.
                assert boxes["title"]["top"] >= boxes["bar"]["bottom"], f"the title shares the toolbar's row: {boxes}"
            shot(page, "browser-overview-titles")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser-readability-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
