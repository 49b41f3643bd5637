"""k ranks' end state held against one device's: the check the gradient-bookkeeping tests share."""

from __future__ import annotations

import torch


def assert_ranks_end_where_one_device_ends(results: list[dict], case: str, reference: dict[str, torch.Tensor], *,
                                           atol: float = 1e-12) -> None:
    """Every rank's `results[rank][case]["state"]` within `atol` of `reference` (float64 runs), and
    the ranks bitwise equal to each other."""
    for rank in results:
        for key, value in reference.items():
            torch.testing.assert_close(rank[case]["state"][key], value, rtol=0, atol=atol, msg=f"{case}: {key}")
    for key, value in results[0][case]["state"].items():
        for rank in results[1:]:
            assert torch.equal(value, rank[case]["state"][key]), (case, key)
