"""nbval settings for the workbench notebooks (collected with ``--nbval-lax notebooks/``).

The notebooks are committed without outputs and end with assert cells, so a broken engine
fails them through errors, not through output comparison. For cells that do opt in to
comparison (``# NBVAL_CHECK_OUTPUT``), plotly figures, widget views and HTML tables (all
full of timings and random ids) are left out, and ``nbval_sanitize.cfg`` masks timings,
paths and addresses in text output.
"""

from __future__ import annotations

import pytest

#: Output MIME types never compared: plotly JSON, widget views, HTML renderings.
SKIP_MIME = ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json",
             "application/vnd.jupyter.widget-state+json", "text/html", "image/png", "image/svg+xml")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Extend nbval's per-notebook ``skip_compare`` with :data:`SKIP_MIME`."""
    for item in items:
        parent = getattr(item, "parent", None)
        if parent is not None and hasattr(parent, "skip_compare"):
            parent.skip_compare = tuple(dict.fromkeys((*parent.skip_compare, *SKIP_MIME)))
