"""Resident memory of an engine against what it must hold: its weights and its KV pool.

Builds once (cached under --cache) a random bf16 model of GLM-5.3's shape at reduced width and
depth (hidden 1536, the first layer dense with intermediate 4096, then MoE layers of 48 routed
experts of 512, top-8, one shared expert; 16 heads, q_lora 768, kv_lora 512; the indexer at 16
heads x 128 dims, top-2048), its block-FP8 copy (scripts/quantize_fp8.py) and its NVFP4 copy
(routed experts 4-bit, scripts/quantize_nvfp4.py). For each checkpoint, in a fresh process each:
the process's resident memory with torch and dsaserve imported (the floor), then after `LLM(...)`
built the engine; the engine's share is the difference, against its parameters' bytes plus its
KV pool's.

    python bench/resident_memory.py [--layers 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=1536, intermediate_size=4096, moe_intermediate_size=512,
             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=48,
             num_experts_per_tok=8, index_topk=2048, index_head_dim=128,
             index_n_heads=16)  # fmt: skip
MEASURE = """
import json, sys
def rss():
    lines = open("/proc/self/status").read().splitlines()
    return next(int(l.split()[1]) * 1024 for l in lines if l.startswith("VmRSS"))
from dsaserve import LLM
floor = rss()
with LLM(sys.argv[1], max_total_tokens=4096) as llm:
    e = llm.engine
    params = sum(p.numel() * p.element_size() for p in e.model.parameters())
    kv = e.pool.kv_cache.nbytes + e.pool.index_cache.nbytes
    print(json.dumps({"floor": floor, "rss": rss(), "params": params, "kv": kv,
                      "decode_path": e.stats()["decode_path"]}))
"""


def checkpoints(cache: Path, layers: int) -> dict[str, Path]:
    bf16, fp8 = cache / f"bf16-{layers}", cache / f"fp8-{layers}"
    if not (bf16 / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        import torch
        from tiny_models import make_checkpoint

        make_checkpoint(bf16, "glm", 0, dtype=torch.bfloat16, num_hidden_layers=layers, **SHAPE)
    if not (fp8 / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "quantize_fp8.py"), str(bf16),
                        str(fp8)], check=True)  # fmt: skip
    nvfp4 = cache / f"nvfp4-{layers}"
    if not (nvfp4 / "config.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "quantize_nvfp4.py"), str(bf16),
                        str(nvfp4)], check=True)  # fmt: skip
    return {"bf16": bf16, "block-FP8": fp8, "NVFP4": nvfp4}


def measure(folder: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(folder)], check=True,
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def model_arguments(parser: argparse.ArgumentParser, json_name: str) -> None:
    """The flags of a bench over these checkpoints: their depth, the repeats, where they go."""
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "dsaserve" / "bench")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / json_name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, "resident.json")
    args = parser.parse_args()
    folders = checkpoints(args.cache, args.layers)
    rows = []
    for repeat in range(args.repeats):
        for name, folder in folders.items():  # alternating
            rows.append({"checkpoint": name, "repeat": repeat, **measure(folder)})
    gib = 2**30
    print("| checkpoint | file GiB | params GiB | KV GiB | engine RSS GiB | ÷ (params + KV) |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        file = sum(f.stat().st_size for f in folders[row["checkpoint"]].glob("*.safetensors"))
        engine = row["rss"] - row["floor"]
        print(f"| {row['checkpoint']} (repeat {row['repeat'] + 1}) | {file / gib:.2f} | "
              f"{row['params'] / gib:.2f} | {row['kv'] / gib:.3f} | {engine / gib:.2f} | "
              f"{engine / (row['params'] + row['kv']):.2f} |")  # fmt: skip
    args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
