"""Artefacts written whole or not at all (the implementation lives in jaxdecode.files, which the
library's own writers — trained-drafter directories — use too)."""
from jaxdecode.files import save_whole  # noqa: F401
