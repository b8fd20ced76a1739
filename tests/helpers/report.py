"""Reading the HTML report: the Vega-Lite specs it embeds."""
from __future__ import annotations

import json
import re


def specs_of(html: str) -> dict:
    match = re.search(r"var specs = (\{.*?\});\n", html, re.DOTALL)
    assert match, "no chart specs in the page"
    return json.loads(match.group(1).replace("<\\/", "</"))
