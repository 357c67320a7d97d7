"""No emoji in what the playground prints (issue 52.10): where no emoji font is installed,
"⏹" and "ℹ️" rendered as empty boxes; the page says it in words instead."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# emoji pictographs, the media-control symbols (⏩-⏺: ⏳ ⏹), ℹ, ⚠ and the emoji presentation
# selector; arrows and ⏎ (shown for a newline token) are in every text font
EMOJI = re.compile("[\U0001F300-\U0001FAFF\u23E9-\u23FA\u2139\u26A0\uFE0F]")


def test_views_and_app_print_no_emoji():
    files = sorted((ROOT / "views").glob("*.py")) + sorted((ROOT / "views").glob("*.js")) + \
        [ROOT / "app.py", ROOT / "assets" / "style.css"]
    found = [f"{f.name}:{i}: {line.strip()}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) if EMOJI.search(line)]
    assert not found, "\n".join(found)
