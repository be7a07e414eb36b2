"""The chat page: static files in the package (ferrum/server/ui/), served at `/` and under `/ui/` by the same
server. The page is a client of the public /v1 API like any other; it needs no build step."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).parent / "ui"


def install_chat_page(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(UI_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")
