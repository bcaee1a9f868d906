import pytest

from tests.draft_models import spec_models
from tests.workers.rank_group import RankGroup


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The speculative tests' targets and drafts (tests.draft_models.spec_models), per module."""
    return spec_models(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="session")
def tp2():
    """Two CPU ranks (gloo) the tensor-parallel tests share, started at their first run."""
    group = RankGroup(2)
    yield group
    group.close()
