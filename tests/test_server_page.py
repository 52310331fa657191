"""The live page at /, in a headless Chromium: type a prompt, generate, find the streamed, coloured text.

Needs Chromium (Debian: apt-get install chromium) and the playwright package (test extra; it
drives the installed browser, nothing is downloaded). Skipped, saying which is missing, otherwise.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("fastapi", reason="the server tests need the server extra: pip install -e '.[server,test]'")
sync_api = pytest.importorskip("playwright.sync_api", reason="the page test needs playwright (pip install playwright)")

from server_launcher import build_spec, running_server  # noqa: E402

from tiny_models import repetitive_prompt  # noqa: E402

CHROMIUM = os.environ.get("SPECULUM_CHROMIUM") or next(
    (path for name in ("chromium", "chromium-browser", "google-chrome") if (path := shutil.which(name))), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium installed (apt-get install chromium, or set SPECULUM_CHROMIUM)"
)


def test_page_streams_coloured_tokens():
    spec = build_spec()
    prompt = " ".join(f"w{t}" for t in repetitive_prompt(24, 5))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server
    try:
        expected = spec.generate(prompt, "anpd", max_new_tokens=48, controller=False)  # same rounds twice
        sources = []
        for chunk in spec.generate(prompt, "anpd", max_new_tokens=48, stream=True, controller=False):
            drafted = chunk.num_draft_tokens
            sources += ["draft"] * drafted + ["target"] * (len(chunk.token_ids) - drafted)
    finally:
        torch.set_num_threads(threads)
    assert "draft" in sources and "target" in sources  # both colours are on the page

    with (
        running_server("--method", "anpd", "--params", '{"controller": false}', "--api-key", "page-key") as server,
        sync_api.sync_playwright() as p,
    ):
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            # behind --api-key the browser logs in once (HTTP Basic, the key as password), as a user would
            page = browser.new_context(http_credentials={"username": "me", "password": "page-key"}).new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("#method option", state="attached")  # the methods came from /v1/models
            assert page.input_value("#method") == "anpd"
            page.fill("#prompt", prompt)
            page.fill("#max_tokens", "48")
            page.click("#go")
            page.wait_for_selector("#output[data-done]", state="attached", timeout=30_000)
            tokens = page.eval_on_selector_all(
                "#output .tok", "spans => spans.map(s => [s.textContent, s.classList.contains('draft')])"
            )
            assert "".join(text for text, _ in tokens) == expected.text
            assert ["draft" if draft else "target" for _, draft in tokens] == sources
            assert page.text_content("#output .prompt") == prompt
            assert float(page.text_content("#s-tps")) > 0
            assert float(page.text_content("#s-mal")) == pytest.approx(expected.stats.mean_acceptance_length, 0.01)
            assert page.text_content("#s-finish") in ("stop", "length")
            assert page.text_content("#error") == ""
        finally:
            browser.close()


def test_page_runs_several_streams_side_by_side():
    spec = build_spec()
    prompt = " ".join(f"w{t}" for t in repetitive_prompt(18, 4, 3))
    expected = spec.generate(prompt, "anpd", max_new_tokens=32, controller=False).text
    with (
        running_server("--method", "anpd", "--params", '{"controller": false}') as server,
        sync_api.sync_playwright() as p,
    ):
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("#method option", state="attached")
            page.fill("#prompt", prompt)
            page.fill("#max_tokens", "32")
            page.fill("#streams", "3")
            page.click("#go")
            for i in range(3):  # three panels, each its own stream, decoded as rows of one batch
                page.wait_for_selector(f'.out[data-stream="{i}"][data-done]', state="attached", timeout=30_000)
            texts = page.eval_on_selector_all(
                ".out", "outs => outs.map(o => [...o.querySelectorAll('.tok')].map(s => s.textContent).join(''))"
            )
            assert texts == [expected] * 3  # greedy: every row gives its single-request text
            metas = page.eval_on_selector_all(".meta", "ms => ms.map(m => m.textContent)")
            assert len(metas) == 3 and all("tok/s" in m and "per forward" in m for m in metas)
            assert page.text_content("#error") == ""
        finally:
            browser.close()
