"""The chat page `jvllm serve` shows at `/` (static files in server/web/, no build step, nothing from a CDN)."""
from __future__ import annotations

import pathlib

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = pathlib.Path(__file__).parent / "web"


def install_web_page(app: FastAPI) -> None:
    """GET / is the page; /web/ its script and style. Public, like /health: the page holds no secret (the API key
    a user types stays in their browser and goes with each API call)."""

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html", media_type="text/html")

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
