"""A batch knows, from how it was built, whether its logits are every token row's in order: a
decode step's then skips the gather of hidden states (a permutation or a subset never does)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attention import ForwardMode
from workers.forward_batch import ForwardBatch


def _batch(q_lens: list[int], logits_rows) -> ForwardBatch:
    table = np.zeros((len(q_lens), 16), dtype=np.int32)
    return ForwardBatch.build(
        ForwardMode.EXTEND,
        rows=list(range(len(q_lens))),
        prefix_lens=[0] * len(q_lens),
        input_ids=[[1] * q for q in q_lens],
        out_cache_loc=torch.arange(sum(q_lens), dtype=torch.int32),
        req_to_token=SimpleNamespace(table=torch.from_numpy(table), host=table),
        logits_rows=logits_rows,
    )


@pytest.mark.parametrize(
    "q_lens, logits_rows, every",
    [
        ([1, 1, 1], range(3), True),  # a decode step
        ([1, 1, 1], [0, 1, 2], True),  # the scheduler's list for one
        ([3], range(3), True),  # a verify of every row
        ([1, 1, 1], [2, 1, 0], False),
        ([1, 1, 1], [0, 2], False),
        ([3, 2], [2, 4], False),  # a prefill's last tokens
        ([1, 1], range(1, 3), False),
        ([1, 1], [], False),
    ],
)
def test_every_row_only_when_the_logits_rows_are_all_rows_in_order(q_lens, logits_rows, every):
    batch = _batch(q_lens, logits_rows)
    rows = sum(q_lens)
    assert batch.logits_of_every_row(rows) == every
    assert np.array_equal(batch.host.logits_indices, np.asarray(list(logits_rows), dtype=np.int64))
    assert not batch.logits_of_every_row(rows + 1)  # other hidden rows (a padded graph batch)
