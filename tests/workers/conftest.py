import pytest

from tests.draft_models import spec_models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The speculative tests' targets and drafts (tests.draft_models.spec_models), per module."""
    return spec_models(tmp_path_factory.mktemp("spec"))
