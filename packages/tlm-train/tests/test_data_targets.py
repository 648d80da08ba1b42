"""How many tokens of laid-out chat data are targets (tlm_train.data._targets): ids stored as themselves (not as
``-1 - id``, a token the loss skips) after each window's first token, counted here by hand."""

import numpy as np

from tlm_train.data import _targets


def test_targets_are_the_non_negative_ids_after_each_windows_first():
    padded = np.array([5, 6, 7, 8, -1, 2, 3, -4], dtype=np.int32)  # two windows of 4
    assert _targets(padded, "padded", 4) == 3 + 2  # (6, 7, 8) and (2, 3); each window's first is no target
    packed = np.array([-1, 6, -8, 8, 2], dtype=np.int32)  # one stream: its first is no target
    assert _targets(packed, "packed", 5) == 3
