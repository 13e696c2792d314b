"""An application whose import logs INFO lines, as one using Flask-Migrate does (Alembic
sets up its autogenerate plugins at import, with an INFO line each): ``sqla-jobs`` must
not print them."""

from __future__ import annotations

import logging

import alembic.autogenerate  # noqa: F401

from .app import talk_jobs as jobs  # noqa: F401

logging.getLogger("tests.noisy_app").info("an INFO line of the app's import")
