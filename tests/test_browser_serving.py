"""API clients and the console together in a real browser, the console attached to an engine server started
first (as `make run` does): chat requests sent through the openai SDK show in the console's Requests table
under their user label and on the Blocks page, and the "Why did it miss?" page of the request whose system
prompt carried another date shows both dates."""

from __future__ import annotations

import openai

from tests.browser_support import ARTIFACTS, launch_page, serve_console
from tests.test_browser import TIMEOUT_MS, go

SYSTEM = "You are the support bot of Example Corp: answer questions on invoices and refunds briefly. Today is {}."


def test_sdk_chat_requests_show_in_the_console_and_the_why_page_shows_the_dates(tmp_path) -> None:
    from playwright.sync_api import expect, sync_playwright

    with serve_console(tmp_path) as server:
        with sync_playwright() as playwright:
            browser, page = launch_page(playwright, expect, height=1100)
            main = page.locator("[data-testid='stMain']").first
            try:
                page.goto(server.url)  # the console is open (and its engine up) before the client sends
                expect(page.get_by_text("KV usage", exact=True).first).to_be_visible(timeout=4 * TIMEOUT_MS)
                client = openai.OpenAI(base_url=f"{server.engine_url}/v1", api_key="unused", max_retries=0)
                ids = [
                    client.chat.completions.create(
                        model="tiny-chat", user="dana", max_tokens=2, temperature=0,
                        messages=[{"role": "system", "content": SYSTEM.format(day)},
                                  {"role": "user", "content": "Where is my refund?"}],
                    ).id
                    for day in ("2026-12-03", "1999-12-04")
                ]  # fmt: skip
                client.close()
                assert all(request_id.startswith("chatcmpl-dana-") for request_id in ids)
                go(page, "Blocks")
                expect(main.get_by_text(ids[1]).first).to_be_visible()  # the API's request holds blocks here
                go(page, "Submit & fork")
                table = main.locator(".st-key-submit_requests [data-testid='stDataFrame']")
                expect(table).to_contain_text(ids[1])
                expect(table).to_contain_text(ids[0])
                go(page, "Why did it miss?")
                field = main.get_by_label("Or any request id")
                field.fill(ids[1])
                field.press("Enter")
                expect(main.get_by_text("diverged", exact=True).first).to_be_visible()
                codes = main.locator("[data-testid='stCode']")
                expect(codes.nth(0)).to_contain_text("1999-12-04")
                expect(codes.nth(1)).to_contain_text("2026-12-03")
                page.screenshot(path=str(ARTIFACTS / "browser-why.png"), full_page=True)
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "browser-serving-failure.png"), full_page=True)
                raise
            finally:
                browser.close()
