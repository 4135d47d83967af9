"""The Capacity planner in a real browser (Debian's chromium via Playwright, `streamlit run app` on
127.0.0.1): analyse the shipped conversation sample and see the curve, the capacity table, the breakdown
and the hot prefixes. The screenshot lands in artifacts/capacity-planner.png."""

from __future__ import annotations

from tests.browser_support import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, ConsoleServer
from tests.test_browser import TIMEOUT_MS, go, shot

ANALYSIS_TIMEOUT_MS = 5 * TIMEOUT_MS  # the 223-request sample under lru, reuse-lru and opt (see the wait below)


def test_the_capacity_planner_analyses_a_sample_in_a_real_browser(console_server: ConsoleServer) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        try:
            page.goto(console_server.url)
            expect(page.get_by_text("KV usage", exact=True).first).to_be_visible(timeout=4 * TIMEOUT_MS)
            go(page, "Capacity planner")
            main = page.locator("[data-testid='stMain']")
            page.get_by_role("button", name="Analyse").click()
            # The analysis takes 0.8 s on an idle machine; on a slow one under load its progress bar was still
            # half way after 60 s (one of three loaded `make test` runs), so the wait allows for that.
            curve_heading = main.get_by_role("heading", name="Miss ratio by cache size")
            expect(curve_heading).to_be_visible(timeout=ANALYSIS_TIMEOUT_MS)
            expect(main.locator("[data-testid='stPlotlyChart'] .main-svg").first).to_be_visible()
            expect(main.get_by_text("maximum: miss ratio", exact=False).first).to_be_visible()
            expect(main.get_by_role("heading", name="Hot prefixes")).to_be_visible()
            expect(main.get_by_text("37.9%", exact=True).first).to_be_visible()  # the sample's maximum hit ratio
            shot(page, "capacity-planner")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "capacity-planner-failure.png"), full_page=True)
            raise
        finally:
            browser.close()
