"""``speculum serve``: an OpenAI-compatible HTTP server with per-request speculation statistics.

Needs the ``server`` extra: ``pip install "speculum[server]"`` (FastAPI, uvicorn, prometheus-client).
"""

from speculum.server.app import ServerSettings, create_app, serve
from speculum.server.validation import server_config

__all__ = ["ServerSettings", "create_app", "serve", "server_config"]
