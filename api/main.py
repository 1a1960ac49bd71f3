"""``uvicorn api.main:app``: the runtime's API from settings: the embedded default (``substrate up``:
API + state manager + local pool) or, with ``SUBSTRATE_ROLE=router``, the API and proxy only
(``substrate router``; templates from files or the Kubernetes API per ``SUBSTRATE_CATALOG_SOURCE``)."""

from api.app import create_app
from substrate.settings import get_settings

app = create_app(embedded=get_settings().role == "embedded")
