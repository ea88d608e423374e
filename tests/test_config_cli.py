"""ModelConfig normalisation, clear start-up errors, and the `dsaserve` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsaserve import __version__
from dsaserve.args import ArgsError, ServerArgs
from dsaserve.model_config import ConfigError, ModelConfig

GLM5 = dict(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048,
    kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, first_k_dense_replace=3, rms_norm_eps=1e-5, index_topk=2048,
    index_n_heads=32, index_head_dim=128, max_position_embeddings=202752,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    num_nextn_predict_layers=1, eos_token_id=[154820, 154827, 154829],
)  # fmt: skip
DSV32 = dict(
    GLM5, model_type="deepseek_v32", hidden_size=7168, num_hidden_layers=61,
    num_attention_heads=128, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128,
    n_group=8, topk_group=4, index_n_heads=64, rms_norm_eps=1e-6, rope_theta=10000,
    rope_parameters=None, max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)  # fmt: skip


def write(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_glm5_config(tmp_path):
    cfg = ModelConfig.from_hf(write(tmp_path, GLM5))
    assert cfg.softmax_scale == pytest.approx(1 / 16)  # 256^-0.5, no YaRN
    assert cfg.indexer_rope_interleave and cfg.kv_entry_dim == 576
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert set(cfg.indexer_types) == {"full"} and cfg.num_nextn_predict_layers == 1


def test_deepseek_v32_config(tmp_path):
    cfg = ModelConfig.from_hf(write(tmp_path, DSV32))
    assert cfg.softmax_scale == pytest.approx(0.135234, rel=1e-5)  # 192^-0.5 * mscale^2
    assert not cfg.indexer_rope_interleave and cfg.n_group == 8


def test_index_share_pattern(tmp_path):
    cfg = ModelConfig.from_hf(write(tmp_path, {**GLM5, "index_topk_freq": 4,
                                               "index_skip_topk_offset": 3}))  # fmt: skip
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    assert full[:5] == [0, 1, 2, 6, 10] and len(full) == 21


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "config.json not found"),
        (lambda p: (p / "config.json").write_text("{nope"), "not valid JSON"),
        (lambda p: write(p, {**GLM5, "model_type": "llama"}), "'llama' is not supported"),
        (lambda p: write(p, {k: v for k, v in GLM5.items() if k != "kv_lora_rank"}),
         "missing field 'kv_lora_rank'"),
    ],
)  # fmt: skip
def test_config_errors_name_the_problem(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="not a folder"):
        ModelConfig.from_hf(tmp_path / "absent")


def test_server_args_refuse_bad_values():
    with pytest.raises(ArgsError, match="--page-size"):
        ServerArgs(page_size=0)
    with pytest.raises(ArgsError, match="--default-chat-template-kwargs"):
        ServerArgs(default_chat_template_kwargs="[1]")
    from dsaserve.assets import default_model_path

    assert ServerArgs.from_cli([]).model_path == str(default_model_path())  # `dsaserve serve`
    args = ServerArgs.from_cli(["--tp", "8", "--mem-fraction-static", "0.8", "--model", "x"])
    assert (args.tp_size, args.mem_fraction_static, args.model_path) == (8, 0.8, "x")


def test_cache_report_on_by_default_and_grammar_backend_flags():
    assert ServerArgs.from_cli([]).enable_cache_report  # on unless turned off
    assert ServerArgs.from_cli(["--enable-cache-report"]).enable_cache_report  # still accepted
    assert not ServerArgs.from_cli(["--disable-cache-report"]).enable_cache_report
    assert ServerArgs.from_cli([]).grammar_backend == "xgrammar"
    assert ServerArgs.from_cli(["--grammar-backend", "none"]).grammar_backend == "none"
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--grammar-backend", "outlines"])


def test_cli_version_and_help():
    run = lambda *a: subprocess.run([sys.executable, "-m", "dsaserve.cli", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run("--version").stdout.strip() == f"dsaserve {__version__}"
    help_text = run("--help").stdout
    assert all(cmd in help_text for cmd in ("serve", "plan", "bench"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--attn-cp-size", "2"], "--attn-cp-size 2"),
        (["--enable-prefill-cp"], "--enable-prefill-cp"),
        (
            ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"],
            "--disaggregation-transfer-backend fake",
        ),
        (["--dsa-decode-backend", "flashmla_kv"], "a CUDA kernel"),  # FP8 KV runs on CPU now
    ],
)
def test_unrunnable_flags_refused_at_start(flags, message):
    from dsaserve.runtime.preflight import refuse_unrunnable

    with pytest.raises(ArgsError, match=message):
        refuse_unrunnable(ServerArgs.from_cli(flags), "cpu")
