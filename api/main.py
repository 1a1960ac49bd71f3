"""``uvicorn api.main:app``: the embedded runtime (API + state manager + local pool) from settings."""

from api.app import create_app

app = create_app()
