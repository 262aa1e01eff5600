"""The screenshot in docs/SERVER.md: `dspark serve`'s page over a running server, one question
asked, taken in headless Chromium (tests/browser.py drives it over the DevTools pipe).

    dspark serve --verify full &          # SmolLM2 + the bundled draft; full: every step drafts
    python scripts/page_screenshot.py --url http://127.0.0.1:8000 --out docs/img/page.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.browser import CHROMIUM, MISSING, Browser  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--out", default="page.png")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--api-key", default=None)
    args = p.parse_args()
    if CHROMIUM is None:
        print(MISSING, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(profile)
        try:
            page = browser.page(args.url.rstrip("/") + "/")
            if args.api_key:
                page.eval(
                    f"document.getElementById('key').value = {args.api_key!r};"
                    "document.getElementById('keyform').requestSubmit()"
                )
            page.eval(
                f"document.getElementById('max_tokens').value = '{args.max_tokens}';"
                f"document.getElementById('prompt').value = {args.prompt!r};"
                "document.getElementById('send').click()"
            )
            page.wait(
                "(() => { const b = [...document.querySelectorAll('.msg.assistant')].pop();"
                " return b && b.dataset.done; })()",
                timeout=600,
            )
            page.wait("document.getElementById('s_tokens').textContent !== '-'")
            page.screenshot(args.out)
        finally:
            browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
