"""The guided scenario in a real browser (chromium via Playwright, `streamlit run app` on loopback).

One click on the Blocks page plays issue 15's exercise; the test then finds the drawn timeline and checks,
on the rendered page, that the words "no holder left: safe to reuse" sit in the row of the parent's
half-full tail (and "evictable from here on" in the shared full block's), not merely somewhere on the
page. The timeline's screenshot lands in artifacts/ (docs/console-sharing-timeline.png is one).
"""

from __future__ import annotations

from tests.browser_support import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, ConsoleServer
from tests.test_browser import TIMEOUT_MS, go

SAFE = "no holder left: safe to reuse"
EVICTABLE = "evictable from here on"
# Every annotation of one Plotly figure, with its box on screen (row titles and marker words alike).
ANNOTATIONS = """plot => Array.from(plot.querySelectorAll('g.annotation')).map(a => {
    const box = a.getBoundingClientRect();
    return {text: a.textContent, top: box.top, bottom: box.bottom};
})"""


def test_the_guided_scenario_marks_the_old_tail_safe_to_reuse_in_a_real_browser(console_server: ConsoleServer) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        try:
            play_scenario(page, console_server.url, expect)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser-scenario-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def play_scenario(page, url: str, expect) -> None:
    main = page.locator("[data-testid='stMain']").first
    page.goto(url)
    expect(page.get_by_text("KV usage", exact=True).first).to_be_visible(timeout=4 * TIMEOUT_MS)
    go(page, "Blocks")
    page.get_by_role("button", name="Run the scenario").click()
    expect(main.get_by_text("The engine is as the scenario found it", exact=False)).to_be_visible(timeout=3 * TIMEOUT_MS)

    timeline = main.locator("[data-testid='stPlotlyChart']").filter(has_text="the parent's half-full tail").first
    expect(timeline).to_be_visible()
    expect(timeline).to_contain_text(SAFE)  # drawn: its marker words are in the SVG
    timeline.scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    timeline.screenshot(path=str(ARTIFACTS / "console-sharing-timeline.png"))

    notes = timeline.locator(".js-plotly-plot").first.evaluate(ANNOTATIONS)
    rows = sorted((n for n in notes if n["text"].startswith("block ")), key=lambda n: n["top"])
    titles = [r["text"] for r in rows]
    assert len(titles) == 4 and titles[0].endswith("the full block, shared")
    assert titles[1].endswith("the parent's half-full tail")
    assert all(t.endswith("'s copy of the tail") for t in titles[2:])

    def words_in_row(index: int) -> list[str]:
        top = rows[index]["bottom"]
        bottom = rows[index + 1]["top"] if index + 1 < len(rows) else float("inf")
        return [n["text"] for n in notes if not n["text"].startswith("block ") and top <= n["top"] < bottom]

    assert words_in_row(1) == [SAFE]  # the parent's old tail: safe to reuse once the parent let go
    assert words_in_row(0) == [EVICTABLE]  # the shared full block is cached: evictable, not free
    assert words_in_row(2) == [SAFE] and words_in_row(3) == [SAFE]  # each child's copy
    page.set_viewport_size({"width": 1400, "height": 2400})  # Streamlit scrolls inside: all of it in view
    page.wait_for_timeout(500)
    scenario = main.locator("[data-testid='stVerticalBlock']").filter(has_text="Guided scenario").last
    scenario.screenshot(path=str(ARTIFACTS / "browser-scenario.png"))  # the timeline and its sentences
