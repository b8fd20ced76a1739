"""Driving `kvtrace explore` in tests: Textual's headless pilot (keys in, the screen's text out)."""
from __future__ import annotations

import asyncio
import io
from collections.abc import Callable

from rich.console import Console


def screen_text(app) -> str:
    """The app's current screen as plain text, one line per terminal row (what a user would read)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system=None, legacy_windows=False, safe_box=False)
    # the whole screen, as Textual's own export_screenshot renders it (there as SVG)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def drive(app, steps: list[str | tuple[str, ...]], size: tuple[int, int] = (80, 24),
          check: Callable | None = None) -> list[str]:
    """Run `app` headless at `size`; the screen's text first, then after each step's keys. `check(app)`,
    if given, runs at the end, inside the app."""
    async def settled(pilot) -> str:
        """The screen once it stops changing (a new screen's footer comes a refresh after it)."""
        text = None
        for _ in range(50):
            await pilot.pause()
            now = screen_text(app)
            if now == text:
                return now
            text = now
        return text

    async def run() -> list[str]:
        screens = []
        async with app.run_test(size=size) as pilot:
            screens.append(await settled(pilot))
            for keys in steps:
                await pilot.press(*((keys,) if isinstance(keys, str) else keys))
                screens.append(await settled(pilot))
            if check is not None:
                check(app)
        return screens

    return asyncio.run(run())
