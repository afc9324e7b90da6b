"""Shared by the chaos tests: their reference cache."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One reference cache for this module's runs (fresh: every reference is computed here);
    runs of the same job and cluster shape share their reference, as a user's do."""
    return tmp_path_factory.mktemp("chaos-cache")
