"""llama.cpp for the side-by-side: build it from the `llama-cpp-python` sdist, convert a checkpoint.

Build: `pip download --no-deps --no-binary :all: llama-cpp-python==VERSION` fetches the sdist,
whose `vendor/llama.cpp` is built with cmake for this CPU (GGML_NATIVE, Release, static, no web
UI, no network code) into `CACHE/build`; a later run finds the binaries there and skips it.

Conversion, with llama.cpp's own `convert_hf_to_gguf.py`, needs what a transformers-5
`glm_moe_dsa` checkpoint does not give it:

- per-expert tensors. transformers 5 saves the routed experts fused (`mlp.experts.gate_up_proj`
  [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); the converter reads the older per-expert
  layout (`mlp.experts.{e}.{gate,up,down}_proj.weight`). `write_converter_layout` writes the
  checkpoint in that layout (a copy of the folder with the fused tensors split; every other
  tensor unchanged), so the converter runs unmodified on it.
- a pre-tokenizer name. The converter recognises a tokenizer by hashing its output on a fixed
  text and refuses an unknown hash. The shim (`SHIM`) runs the converter's `main()` with only
  `TextModel.get_vocab_base_pre` replaced, returning a fixed name (`glm4`). The benchmark feeds
  token ids to both engines, so the name only matters for text prompts, which it never sends.
- GLM's special tokens (`[gMASK]`, `<|user|>`, `<|endoftext|>`, `<|observation|>`), which the
  converter looks up by name: `add_glm_specials` adds those a test tokenizer lacks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-cli")
PRE_TOKENIZER = "glm4"
GLM_SPECIALS = ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")
SHIM = """
import sys
sys.path[:0] = [{src!r}, {gguf_py!r}]
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def cmake_command(source: Path, build: Path) -> list[str]:
    """The configure command: a native CPU build with only what the benchmark runs."""
    flags = {
        "CMAKE_BUILD_TYPE": "Release",
        "GGML_NATIVE": "ON",
        "BUILD_SHARED_LIBS": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_SERVER": "ON",
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_CURL": "OFF",
    }
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return ["cmake", "-S", str(source), "-B", str(build), *generator,
            *(f"-D{k}={v}" for k, v in flags.items())]  # fmt: skip


def source_dir(cache: Path, version: str = DEFAULT_VERSION) -> Path:
    """The vendored llama.cpp of the sdist, downloaded and unpacked into `cache` once."""
    root = cache / f"llama_cpp_python-{version}"
    source = root / "vendor" / "llama.cpp"
    if source.is_dir():
        return source
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", f"llama-cpp-python=={version}", "-d", str(cache)],
                       check=True)  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return source


def build(cache: Path, version: str = DEFAULT_VERSION, jobs: int = 2) -> Path:
    """The folder holding llama-server / llama-bench / llama-cli, built once into the cache."""
    bin_dir = cache / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    source = source_dir(cache, version)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    subprocess.run([*nice, *cmake_command(source, cache / "build")], check=True)
    subprocess.run([*nice, "cmake", "--build", str(cache / "build"), "-j", str(jobs),
                    "--target", *TARGETS], check=True)  # fmt: skip
    return bin_dir


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors -> the per-expert names the converter reads; others unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for expert, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{prefix}{expert}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}{expert}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for expert, down in enumerate(tensor):
                out[f"{prefix}{expert}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = tensor
    return out


def write_converter_layout(checkpoint: Path, out: Path) -> Path:
    """A copy of `checkpoint` (safetensors, config, tokenizer) with per-expert tensors."""
    out.mkdir(parents=True, exist_ok=True)
    for file in checkpoint.iterdir():
        if (
            file.is_file()
            and file.suffix != ".safetensors"
            and file.name != "model.safetensors.index.json"
        ):
            shutil.copy2(file, out / file.name)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    save_file(split_experts(tensors), out / "model.safetensors", metadata={"format": "pt"})
    add_glm_specials(out / "tokenizer.json")
    return out


def add_glm_specials(tokenizer: Path) -> None:
    """The converter's GLM vocabulary looks up four special tokens by name; a test tokenizer
    without some of them gets them added at the next free ids (the benchmark sends ids only)."""
    data = json.loads(tokenizer.read_text())
    added = data.setdefault("added_tokens", [])
    names = {t["content"] for t in added}
    used = [*data["model"]["vocab"].values(), *(t["id"] for t in added)]
    next_id = max(used) + 1
    for name in GLM_SPECIALS:
        if name not in names:
            added.append({"id": next_id, "content": name, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True})  # fmt: skip
            next_id += 1
    tokenizer.write_text(json.dumps(data))


def converter_command(source: Path, layout: Path, gguf: Path, outtype: str = "f32") -> list[str]:
    """python -c SHIM: the converter's own main() with only the pre-tokenizer name fixed."""
    args = [str(layout), "--outfile", str(gguf), "--outtype", outtype]
    shim = SHIM.format(src=str(source), gguf_py=str(source / "gguf-py"), args=args,
                       pre=PRE_TOKENIZER)  # fmt: skip
    return [sys.executable, "-c", shim]


def convert(source: Path, checkpoint: Path, work: Path, outtype: str = "f32") -> Path:
    """checkpoint -> work/model-f32.gguf (reused when newer than the checkpoint's config)."""
    gguf = work / f"model-{outtype}.gguf"
    config = checkpoint / "config.json"
    stamp = work / "source.json"
    key = json.dumps({"checkpoint": str(checkpoint.resolve()),
                      "mtime": max(f.stat().st_mtime for f in checkpoint.iterdir())})  # fmt: skip
    if gguf.is_file() and stamp.is_file() and stamp.read_text() == key and config.is_file():
        return gguf
    layout = write_converter_layout(checkpoint, work / "per_expert")
    subprocess.run(converter_command(source, layout, gguf, outtype), check=True)
    stamp.write_text(key)
    return gguf
