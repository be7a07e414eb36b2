"""Takes docs/chat-ui.png: the chat page of `ferrum serve` on the demo model after one question, in headless
Chromium (Debian's, driven by Playwright).

    python scripts/ui_screenshot.py [--model models/SmolLM2-135M-Instruct] [--out docs/chat-ui.png]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.live_server import live_server  # noqa: E402  (starts and stops `ferrum serve`)
from tests.ui.test_chat_page import CHROMIUM_ARGS  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "chat-ui.png")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    with live_server("--model", str(args.model), "--backend", "cpu") as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(url + "/")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "120")
        for question in ("What is the capital of France?", "Give me three facts about Paris as a list."):
            page.fill("#prompt", question)
            page.click("#send")
            page.wait_for_selector('body[data-busy="0"]', state="attached", timeout=120_000)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out))
        browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
