"""Speculative flags: SGLang's defaults, and combinations that cannot work fail at start with a
message that says what to change."""

from __future__ import annotations

import pytest
from speculative_models import make_mtp_checkpoint
from tiny_models import make_checkpoint

from dsaserve import LLM
from dsaserve.args import ArgsError, ServerArgs, speculative_settings


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
          "--speculative-num-draft-tokens", "6"], "set --speculative-num-draft-tokens 4"),
        (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"],
         "use --speculative-eagle-topk 1"),
        (["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "0"],
         "--speculative-num-steps must be >= 1"),
        (["--speculative-num-steps", "3"], "need --speculative-algorithm EAGLE"),
    ],
)  # fmt: skip
def test_bad_combinations_fail_at_parse(argv, message):
    with pytest.raises(ArgsError, match=message.replace("+", r"\+")):
        ServerArgs.from_cli(argv)


def test_other_sglang_algorithms_parse_but_are_refused_at_start():
    args = ServerArgs.from_cli(["--speculative-algorithm", "EAGLE3"])  # planner/guide commands
    with pytest.raises(ArgsError, match="use EAGLE"):
        speculative_settings(args)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({}, None),
        ({"speculative_algorithm": "EAGLE"}, (3, 1, 4)),
        ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 5}, (5, 1, 6)),
        ({"speculative_algorithm": "EAGLE", "speculative_num_draft_tokens": 2}, (1, 1, 2)),
        ({"speculative_algorithm": "EAGLE", "speculative_num_steps": 1,
          "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2}, (1, 1, 2)),
    ],
)  # fmt: skip
def test_defaults(flags, expected):
    assert speculative_settings(ServerArgs(**flags)) == expected


def test_checkpoint_without_mtp_is_refused(tmp_path):
    ckpt = make_checkpoint(tmp_path / "plain", "glm", seed=1)
    with pytest.raises(ArgsError, match="no MTP .* drop --speculative-algorithm"):
        LLM(str(ckpt), max_total_tokens=512, speculative_algorithm="EAGLE")


def test_engine_defaults_with_speculation(tmp_path):
    ckpt = make_mtp_checkpoint(tmp_path / "mtp", "glm", seed=1)
    engine = LLM(str(ckpt), max_total_tokens=512, speculative_algorithm="NEXTN").engine
    assert engine.scheduler.config.max_running_requests == 48
    assert engine.spec.num_steps == 3 and engine.scheduler.config.decode_tokens == 4
    assert engine.pool.kv_cache.shape[0] == engine.model_config.num_hidden_layers + 1
    plain = LLM(str(ckpt), max_total_tokens=512).engine
    assert plain.spec is None and plain.scheduler.config.max_running_requests != 48
    assert plain.pool.kv_cache.shape[0] == plain.model_config.num_hidden_layers
