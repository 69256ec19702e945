"""``python -m dturbo`` is the ``dturbo`` command."""

from .cli import app

app()
