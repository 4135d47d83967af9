"""The Fleet pages in a real browser: Debian's chromium, driven by Playwright, against `streamlit run app`
watching two pods that are vLLM's own KVCacheManager published by vLLM's own ZmqEventPublisher.

The pods publish before the console starts, so its collector joins late and recovers every batch
through the replay sockets. The walk checks each page's headline numbers against what vLLM's block pools
hold, routes a prompt, and saves a screenshot of each page to artifacts/ (git-ignored;
docs/images/console-fleet-pods.png is one of them).

Without chromium the test skips locally and fails when CI=true; without vLLM it skips.
"""

from __future__ import annotations

import re

import pytest

from tests.browser_support import ARTIFACTS, launch_page
from tests.fleet_support import fleet_console  # noqa: F401 (the fixture)
from tests.test_browser import TIMEOUT_MS, click_until, page_heading, shot

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="vLLM is installed by requirements-interop.txt")

SHARED = list(range(100, 112))  # three 4-token blocks both pods cache
LONG = list(range(1000, 1046))  # pod a's second request: 11 full blocks, evicting some of its first


def publish(pods) -> None:
    """Both pods cache SHARED (a with two blocks of its own after it); then a's longer request evicts."""
    a, b = pods
    first = a.request(SHARED + list(range(500, 509)))
    for pod, request in ((a, first), (b, b.request(SHARED + [7]))):
        pod.allocate(request)
        pod.publish()
    a.free(first)
    a.allocate(a.request(LONG))
    a.publish()


def test_the_fleet_pages_show_vllm_pods_in_a_real_browser(fleet_console) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, pods = fleet_console
    publish(pods)
    held = sum(sum(pod.cached().values()) for pod in pods)
    shared = len(set(pods[0].cached()) & set(pods[1].cached()))
    with sync_playwright() as playwright:
        browser, page = launch_page(playwright, expect)
        try:
            walk(page, url, expect, (held, shared))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "fleet-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def metric(page, label: str):
    return page.locator("[data-testid='stMain'] [data-testid='stMetric']").filter(has_text=label).first


def go(page, link: str, title: str) -> None:
    """Open a page from the sidebar (every page is listed); click again if a rerun in flight swallowed
    the first click."""
    click_until(page.get_by_role("link", name=link, exact=True), page_heading(page, title))


def walk(page, url: str, expect, counts: tuple[int, int]) -> None:
    held, shared = counts
    main = page.locator("[data-testid='stMain']").first
    page.goto(f"{url}/fleet_pods")  # starts the console (the model loads) and its collector
    expect(main.get_by_role("heading", name="Fleet pods", exact=True)).to_be_visible(timeout=4 * TIMEOUT_MS)

    # Pods: both pods, every block their vLLM pools hold (recovered by replay), and their /metrics.
    expect(metric(page, "Pods")).to_contain_text("2")
    expect(metric(page, "Blocks held")).to_contain_text(str(held))
    expect(metric(page, "Live or idle")).to_contain_text("2")
    shot(page, "fleet-01-pods")

    # The prefix tree: the blocks of the shared system prompt both pods still hold.
    go(page, "Fleet prefix tree", "Fleet prefix tree")
    expect(metric(page, "Held by 2+ pods")).to_contain_text(re.compile(rf"Held by 2\+ pods\s*{shared}\b"))
    expect(main.get_by_text("Deepest prefixes and who holds them")).to_be_visible()
    shot(page, "fleet-02-prefix-tree")

    # Evictions: pod a's longer request evicted cached blocks; their ages are known.
    go(page, "Fleet evictions", "Fleet evictions and lifetimes")
    evictions = metric(page, "Evictions")
    for _ in range(20):  # the console's writer commits in the background: Refresh until the rows are in
        if re.search(r"Evictions\s*[1-9]", evictions.inner_text()):
            break
        page.get_by_role("button", name="Refresh").click()
        page.wait_for_timeout(500)
    expect(evictions).to_contain_text(re.compile(r"Evictions\s*[1-9]"))
    expect(metric(page, "Of unknown age")).to_contain_text("0")
    shot(page, "fleet-03-evictions")

    # Route a prompt: pod a holds LONG's 11 full blocks, pod b none of them.
    go(page, "Route a prompt", "Route a prompt")
    page.get_by_text("Token ids", exact=True).click()
    box = page.get_by_role("textbox", name="Token ids (commas or spaces)")
    box.fill(", ".join(map(str, LONG + [1, 2])))
    box.press("Control+Enter")
    page.get_by_role("button", name="Route", exact=True).click()
    expect(main.get_by_text("Route to vllm-a: 44 of 48 prompt tokens cached (11 blocks).")).to_be_visible()
    shot(page, "fleet-04-route")
