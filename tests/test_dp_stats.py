"""The server's statistics under DP attention, summed from its attention groups' (the
dp_controller's `sum_stats`, what `/get_server_info` and `/metrics` report)."""

from __future__ import annotations

from dsaserve.server.dp_controller import sum_stats


def group(verifies: int, accept_length: float, accept_rate: float) -> dict:
    return {"prompt_tokens": 10, "cached_tokens": 5, "cache_hit_rate": 0.5,
            "spec_verify_ct": verifies, "avg_spec_accept_length": accept_length,
            "spec_accept_rate": accept_rate, "spec_num_steps": 2}  # fmt: skip


def test_counts_sum_and_rates_come_from_the_sums():
    total = sum_stats([group(3, 2.0, 0.5), group(1, 3.0, 1.0)])
    assert total["prompt_tokens"] == 20 and total["spec_verify_ct"] == 4
    assert total["cache_hit_rate"] == 0.5
    assert total["avg_spec_accept_length"] == (3 * 2.0 + 1 * 3.0) / 4
    assert total["spec_accept_rate"] == (3 * 0.5 + 1 * 1.0) / 4
    assert total["spec_num_steps"] == 2  # a setting, not a count


def test_an_idle_group_does_not_pull_the_accept_length_down():
    """Four groups, one of which verified nothing: the accept length is the others' (it was
    averaged over all four, 0.75 where every verify emitted one token)."""
    total = sum_stats([group(2, 1.0, 0.0)] * 3 + [group(0, 0.0, 0.0)])
    assert total["avg_spec_accept_length"] == 1.0
    assert sum_stats([group(0, 0.0, 0.0)] * 2)["avg_spec_accept_length"] == 0.0
