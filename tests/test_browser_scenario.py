"""The guided scenario in a real browser (chromium via Playwright, `streamlit run app` on loopback).

One click on the Blocks page plays issue 15's exercise; the test then finds the drawn timeline and checks,
on the rendered page, that the words "no holder left: safe to reuse" sit in the row of the parent's
half-full tail (and "evictable from here on" in the shared full block's), not merely somewhere on the
page. The timeline's screenshot lands in artifacts/ (docs/images/console-sharing-timeline.png is one).
"""

from __future__ import annotations

import re
import shutil

from tests.browser_support import ARTIFACTS, ROOT, ConsoleServer, launch_page
from tests.test_browser import TIMEOUT_MS, go, shot

DOCS = ROOT / "docs" / "images"  # the screenshots the docs show, refreshed by these tests

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
        browser, page = launch_page(playwright, expect, height=1100)
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


def test_the_blocks_page_after_the_scenario_keeps_every_marker_whole(console_server: ConsoleServer) -> None:
    """After the exercise the Blocks page (docs/images/console-blocks.png) draws every marker's words inside its
    figure, the scenario's four rows titled as before."""
    from playwright.sync_api import expect, sync_playwright

    from tests.test_browser import MARKER_BOXES

    with sync_playwright() as playwright:
        browser, page = launch_page(playwright, expect, height=1100)
        try:
            play_scenario(page, console_server.url, expect)
            main = page.locator("[data-testid='stMain']").first
            for chart in main.locator("[data-testid='stPlotlyChart']").filter(has_text=SAFE).all():
                boxes = chart.locator(".js-plotly-plot").first.evaluate(MARKER_BOXES)
                assert all(b["right"] <= b["svg_right"] + 0.5 for b in boxes), f"a marker runs off the figure: {boxes}"
            page.set_viewport_size({"width": 1400, "height": 1100})
            shot(page, "console-blocks")
            shutil.copy(ARTIFACTS / "console-blocks.png", DOCS / "console-blocks.png")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser-scenario-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def test_the_replay_page_says_why_an_exact_replay_saved_nothing(tmp_path) -> None:
    """A hybrid model (every other layer sliding, W = 64): a second prompt sharing the first's 96 tokens hits
    them, but the window state kept was not the window's; the page says so in a sentence
    (docs/images/console-replay.png)."""
    from playwright.sync_api import expect, sync_playwright

    from tests.browser_support import serve_console
    from tests.test_browser import PROMPT, apply_text

    with serve_console(tmp_path, num_blocks=64, attention="hybrid:64") as server:
        with sync_playwright() as playwright:
            browser, page = launch_page(playwright, expect)
            try:
                main = page.locator("[data-testid='stMain']").first
                page.goto(server.url)
                expect(page.get_by_text("KV usage", exact=True).first).to_be_visible(timeout=4 * TIMEOUT_MS)
                go(page, "Submit & fork")
                preview = main.get_by_text(re.compile(r"full blocks? of 16"))
                for number, text in enumerate((PROMPT * 2, PROMPT * 2 + " And one more question.")):
                    apply_text(page, "Submit & fork", "Prompt", text, shown=preview.filter(has_text="tokens"))
                    page.get_by_role("button", name="Submit", exact=True).click()
                    expect(main.get_by_text(f"Submitted req-{number}")).to_be_visible()
                    expect(main.get_by_text(re.compile(rf"^req-{number} · finished"))).to_be_visible()
                go(page, "Replay")
                said = main.get_by_text(re.compile(r"^req-1 · exact replay: the hit reached h = \d+"))
                expect(said).to_be_visible()
                expect(said).to_contain_text("Ready state needed")
                shot(page, "console-replay")
                shutil.copy(ARTIFACTS / "console-replay.png", DOCS / "console-replay.png")
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "browser-replay-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
