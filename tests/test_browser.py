"""One real-browser walk through the console: Debian's chromium, driven by Playwright, against
`streamlit run app` in a subprocess (tiny-chat model, temporary SQLite history, 127.0.0.1 only).

It submits a retained request, forks it twice in one action, finds the shared blocks at reference
count 3 on the Blocks page, forces evictions (a second request, then a confirmed cache reset) and finds
them on the Evictions page. Screenshots land in artifacts/ (git-ignored).

Without chromium the test skips locally and fails when CI=true (the `console_server` fixture, in
tests/browser_support.py).
"""

from __future__ import annotations

import re

from tests.browser_support import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS

TIMEOUT_MS = 60_000
PROMPT = "Operators share one long system prompt across many requests, so its blocks are cached once. " * 2


def test_submit_fork_inspect_evict_in_a_real_browser(console_server: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        try:
            walk(page, console_server, expect)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def shot(page, name: str) -> None:
    """A screenshot of the whole page: Streamlit scrolls inside its main section, so grow the viewport."""
    page.wait_for_timeout(800)  # let charts finish drawing
    height = page.evaluate(
        "() => Math.max(...Array.from(document.querySelectorAll('[data-testid=\"stMain\"], "
        "[data-testid=\"stMainBlockContainer\"]')).map(e => e.scrollHeight), 900)"
    )
    size = page.viewport_size
    page.set_viewport_size({"width": size["width"], "height": min(int(height) + 80, 6000)})
    page.wait_for_timeout(800)
    page.wait_for_function(  # every chart drawn (a live panel may be redrawing one)
        "() => Array.from(document.querySelectorAll('[data-testid=\"stPlotlyChart\"]'))"
        ".every(c => c.querySelector('.main-svg'))",
        timeout=15_000,
    )
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))
    page.set_viewport_size(size)


def walk(page, url: str, expect) -> None:
    main = page.locator("section.stMain, [data-testid='stMain']").first

    # The engine starts with the first session.
    page.goto(url)
    expect(page.get_by_text("KV usage", exact=True).first).to_be_visible(timeout=4 * TIMEOUT_MS)  # loads the model

    # Submit a retained request.
    go(page, "Submit & fork")
    page.get_by_role("textbox", name="Prompt", exact=True).fill(PROMPT)
    page.get_by_role("textbox", name="Prompt", exact=True).press("Control+Enter")
    expect(main.get_by_text("full blocks of 16")).to_be_visible()
    page.get_by_role("spinbutton", name="Max new tokens").fill("4")
    page.get_by_role("spinbutton", name="Max new tokens").press("Enter")
    page.get_by_text("Ignore EOS").click()
    page.get_by_text("Retain as fork base").click()
    page.get_by_role("button", name="Submit", exact=True).click()
    expect(main.get_by_text("Submitted req-0")).to_be_visible()
    expect(main.get_by_text("req-0 · retained", exact=False).first).to_be_visible()

    # Fork it twice in one action (children retained, so all three hold the shared blocks).
    page.get_by_role("textbox", name="Suffixes, one child per line").fill(" Answer briefly.\n Answer in detail.")
    page.get_by_role("textbox", name="Suffixes, one child per line").press("Control+Enter")
    page.get_by_text("Retain children").click()
    page.get_by_role("button", name="Fork children").click()
    expect(main.get_by_text("Forked req-0 into 2 children: req-1, req-2.")).to_be_visible()
    expect(main.get_by_text("req-2 · retained", exact=False).first).to_be_visible()
    shot(page, "02-submit-and-fork")

    # Blocks: the parent's full blocks are shared by all three requests. Click one in the grid...
    go(page, "Blocks")
    expect(main.get_by_text("referenced ×3", exact=True).first).to_be_visible()
    click_block(page, 1, num_blocks=24)
    expect(main.get_by_role("heading", name="Block 1 — referenced ×3")).to_be_visible()
    metric = main.locator("[data-testid='stMetric']").filter(has_text="Reference count")
    expect(metric).to_contain_text("3")
    # ...or type its id.
    page.get_by_role("spinbutton", name="Block id").fill("0")
    page.get_by_role("spinbutton", name="Block id").press("Enter")
    expect(main.get_by_role("heading", name="Block 0 — referenced ×3")).to_be_visible()
    expect(metric).to_contain_text("3")
    expect(main.get_by_text("holders:")).to_contain_text("req-0")
    shot(page, "03-blocks")

    # Prefix tree: drawn from the cached blocks.
    go(page, "Prefix tree")
    expect(main.get_by_text("Inspect a prefix")).to_be_visible()
    shot(page, "04-prefix-tree")

    # Force evictions: a second, unretained request leaves cached blocks; reset them, confirming first.
    go(page, "Submit & fork")
    page.get_by_role("textbox", name="Prompt", exact=True).fill("A different prompt that shares nothing with the first one at all. " * 4)
    page.get_by_role("textbox", name="Prompt", exact=True).press("Control+Enter")
    page.get_by_text("Retain as fork base").click()  # off again
    page.get_by_role("button", name="Submit", exact=True).click()
    expect(main.get_by_text("Submitted req-3")).to_be_visible()
    expect(main.get_by_text("req-3 · finished", exact=False).first).to_be_visible()

    go(page, "Settings")
    page.get_by_role("button", name="Reset prefix cache…").click()
    expect(main.get_by_text("Reset the prefix cache of the shared engine?")).to_be_visible()
    page.get_by_role("button", name="Confirm reset").click()
    expect(main.get_by_text("blocks evicted")).to_be_visible()

    # Evictions: the reset's rows are in the persisted log.
    go(page, "Evictions")
    # The count heading ("N evictions"), not the page title: the rows may land after the first render.
    heading = main.get_by_role("heading", name=re.compile(r"^[\d,]+ evictions$"))
    expect(heading).to_be_visible()
    for _ in range(20):  # the writer commits in the background; Refresh until the rows are there
        if not heading.inner_text().startswith("0 "):
            break
        page.get_by_role("button", name="Refresh").click()
        page.wait_for_timeout(500)
    expect(heading).not_to_have_text("0 evictions")
    expect(main.locator("[data-testid='stDataFrame']").first).to_be_visible()
    shot(page, "05-evictions")

    # Overview after all that: the headline numbers and their history charts.
    go(page, "Overview")
    expect(main.get_by_text("KV usage and hit rate")).to_be_visible()
    shot(page, "06-overview")


def go(page, title: str) -> None:
    """Open a page from the sidebar; click again if a rerun in flight swallowed the first click."""
    heading = page.locator("[data-testid='stMain']").get_by_role("heading", name=title, exact=True).first
    for _ in range(3):
        page.get_by_role("link", name=title, exact=True).click()  # not "Fleet prefix tree" for "Prefix tree"
        try:
            heading.wait_for(state="visible", timeout=TIMEOUT_MS // 3)
            return
        except Exception:  # retried below; the last attempt reports
            pass
    heading.wait_for(state="visible")


def click_block(page, block_id: int, num_blocks: int) -> None:
    """Click one cell of the block grid (the figure has a 6 px pad around square cells).

    The live grid may be redrawing when we look, so locate it again until a click lands.
    """
    from app.charts import grid_cell_px, grid_columns

    cell, cols = grid_cell_px(num_blocks), grid_columns(num_blocks)
    plot = page.locator("[data-testid='stPlotlyChart'] .js-plotly-plot .nsewdrag").first
    heading = page.get_by_role("heading", name=f"Block {block_id} —")
    for _ in range(10):
        plot.wait_for(state="visible")
        box = plot.bounding_box()
        if box is not None:
            x = box["x"] + (block_id % cols) * cell + cell / 2
            y = box["y"] + (block_id // cols) * cell + cell / 2
            page.mouse.move(x, y)
            page.wait_for_timeout(300)  # plotly picks the point on hover, then takes the click
            page.mouse.click(x, y)
            try:
                heading.wait_for(state="visible", timeout=10_000)
                return
            except Exception:  # the grid was redrawn under the pointer; try again
                pass
        page.wait_for_timeout(500)
    raise AssertionError(f"clicking block {block_id} in the grid did not select it")
