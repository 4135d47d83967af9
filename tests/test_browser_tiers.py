"""Both KV tiers in a real browser (issue 44): an engine server with a disk tier (`cli serve --offload-dir`)
serves a prompt, a second one that evicts it to disk, then the first again, promoted from disk; the Blocks
page marks the promoted pool blocks and lists the tier's blocks, and the Overview shows both tiers with the
hits each served. The two views are saved as docs/images/blocks-tiers.png and docs/images/overview-tiers.png.
"""

from __future__ import annotations

import shutil
import time

import openai

from tests.browser_support import ARTIFACTS, ROOT, launch_page, serve_console
from tests.test_browser import TIMEOUT_MS, go

DOCS = ROOT / "docs" / "images"
BLOCKS = 12  # blocks of 16: a 150-token prompt takes 10, so the next one evicts the last one's to disk


def prompt(seed: int, length: int = 150) -> list[int]:
    return [(seed * 7919 + i * 31) % 900 + 10 for i in range(length)]


def clip(page, top_locator, bottom_locator, name: str) -> None:
    """A screenshot of the main section from `top_locator`'s top to `bottom_locator`'s bottom."""
    top, bottom = top_locator.bounding_box(), bottom_locator.bounding_box()
    main = page.locator("[data-testid='stMain']").first.bounding_box()
    box = {"x": main["x"], "y": top["y"] - 12, "width": main["width"], "height": bottom["y"] + bottom["height"] - top["y"] + 24}
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), clip=box)
    shutil.copy(ARTIFACTS / f"{name}.png", DOCS / f"{name}.png")


def test_blocks_and_overview_show_both_tiers_in_a_real_browser(tmp_path) -> None:
    from playwright.sync_api import expect, sync_playwright

    tier = ("--offload-dir", str(tmp_path / "tier"), "--offload-gib", "0.001")
    with serve_console(tmp_path, num_blocks=BLOCKS, serve_args=tier) as server:
        with sync_playwright() as playwright:
            browser, page = launch_page(playwright, expect, height=2600)  # Streamlit scrolls inside: all in view
            main = page.locator("[data-testid='stMain']").first
            try:
                page.goto(server.url)
                expect(page.get_by_text("KV usage", exact=True).first).to_be_visible(timeout=4 * TIMEOUT_MS)
                client = openai.OpenAI(base_url=f"{server.engine_url}/v1", api_key="unused", max_retries=0)

                def complete(token_ids: list[int]):
                    return client.completions.create(model="tiny-chat", prompt=token_ids, max_tokens=2, extra_body={"ignore_eos": True})

                complete(prompt(1))
                complete(prompt(2))  # evicts the first prompt's blocks to the tier
                time.sleep(0.5)  # the tier's writer stores them off the step
                complete(prompt(3, 3))  # a step that takes the finished stores in
                by_tier = complete(prompt(1)).usage.prompt_tokens_details.cached_tokens_by_tier
                client.close()
                assert by_tier["disk"] > 0, by_tier

                go(page, "Blocks")
                section = main.locator(".st-key-blocks_disk_tier")
                expect(section.get_by_text("promoted from disk in their current life", exact=False)).to_be_visible()
                expect(section.locator("[data-testid='stDataFrame']")).to_be_visible()
                expect(main.get_by_text("promoted from disk", exact=True).first).to_be_visible()  # the legend
                grid = main.locator("[data-testid='stPlotlyChart']").first
                expect(grid.locator(".main-svg").first).to_be_visible()
                page.wait_for_timeout(500)  # the data grid's canvas paints after it is attached
                legend = main.locator("[data-testid='stMarkdownContainer']").filter(has_text="promoted from disk").first
                clip(page, legend, section, "blocks-tiers")

                go(page, "Overview")
                table = main.locator("[data-testid='stTable']").filter(has_text="memory (KV pool)")
                expect(table).to_contain_text("disk")
                hits = main.get_by_text("from memory", exact=False).first
                expect(hits).to_be_visible()
                clip(page, main.get_by_role("heading", name="KV tiers").first, hits, "overview-tiers")
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "browser-tiers-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
