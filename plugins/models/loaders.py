"""Weight loaders: safetensors, PyTorch pickles, GGUF files and random weights."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from tqdm import tqdm

from srv.sdk.models import ModelLoader
from srv.sdk.paths import write_atomically

logger = logging.getLogger("srv.loader")


class SafetensorsLoader(ModelLoader):
    """*.safetensors files in name order; with --model-loader-extra-config
    {"enable_multithread_load": true, "num_threads": N} (SGLang's keys) N files are read at once.
    Each file is memory-mapped, or with --weight-loader-disable-mmap read whole into memory
    first (for file systems where mapping is slow or unsupported)."""

    extra_config_keys = frozenset({"enable_multithread_load", "num_threads"})
    DEFAULT_THREADS = 8

    def accepts(self, path: Path) -> bool:
        return path.is_dir() and any(path.glob("*.safetensors"))

    def load(self, model: nn.Module, model_dir: Path) -> None:
        config = self.extra_config()
        threads = int(config.get("num_threads", self.DEFAULT_THREADS)) if config.get("enable_multithread_load") else 1
        mmap = not getattr(self.server_args, "weight_loader_disable_mmap", False)
        model.load_weights(self._tensors(model_dir, threads, mmap))

    @staticmethod
    def _tensors(model_dir: Path, threads: int = 1, mmap: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        if threads <= 1 or len(files) == 1:
            for file in files:
                yield from _file_tensors(file, mmap)
            return
        # Files read ahead in threads (safetensors reads release the GIL), handed on in name order.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(files)), thread_name_prefix="srv-load") as pool:
            for tensors in pool.map(lambda file: list(_file_tensors(file, mmap)), files):
                yield from tensors


def _file_tensors(file: Path, mmap: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    if not mmap:
        from safetensors.torch import load

        tensors = load(file.read_bytes())
        for name in tqdm(list(tensors), desc=f"loading {file.name}", unit="tensor", disable=None, leave=False):
            yield name, tensors.pop(name)
        return
    with safe_open(str(file), framework="pt") as f:
        names = list(f.keys())
        for name in tqdm(names, desc=f"loading {file.name}", unit="tensor", disable=None, leave=False):
            yield name, f.get_tensor(name)


class PtLoader(ModelLoader):
    PATTERNS = ("*.bin", "*.pt")

    def accepts(self, path: Path) -> bool:
        return path.is_dir() and any(any(path.glob(p)) for p in self.PATTERNS)

    def load(self, model: nn.Module, model_dir: Path) -> None:
        files = sorted(f for p in self.PATTERNS for f in model_dir.glob(p))
        if not files:
            raise FileNotFoundError(f"no *.bin or *.pt weight files in {model_dir}")
        for file in files:
            model.load_weights(torch.load(file, map_location="cpu", weights_only=True).items())


class GGUFLoader(SafetensorsLoader):
    """Dequantizes a GGUF file once into a cached Hugging Face directory, then loads that.

    The directory's weights are float32. A model served in another dtype (bf16) loads a copy in
    that dtype, made once beside them (`<dtype>/model.safetensors`): its tensors become the
    parameters as they lie in the file's map, where converting float32 tensors into fresh memory
    cost every warm launch a pass over the weights and their page faults. The copy holds what the
    conversion would give (the same rounding), so the model is the same either way."""

    def accepts(self, path: Path) -> bool:
        return path.is_file() and path.suffix == ".gguf"

    def prepare(self, path: Path) -> Path:
        from srv.plugins.models.gguf_convert import convert_gguf

        return convert_gguf(path)

    def load(self, model: nn.Module, model_dir: Path) -> None:
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if len(dtypes) == 1 and torch.float32 not in dtypes:
            typed = served_dtype_copy(model_dir, dtypes.pop())
            if typed is not None:
                model_dir = typed
        super().load(model, model_dir)


def served_dtype_copy(model_dir: Path, dtype: torch.dtype) -> Path | None:
    """The directory of `model_dir`'s weights in `dtype`, written on first use; None where it
    cannot be written (a read-only cache: the float32 weights load and convert then)."""
    from safetensors.torch import save_file

    typed = model_dir / str(dtype).removeprefix("torch.")
    target = typed / "model.safetensors"
    if target.exists():
        return typed
    tensors = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
               for name, tensor in SafetensorsLoader._tensors(model_dir)}
    try:
        write_atomically(target, lambda tmp: save_file(tensors, str(tmp)), mode=0o644)
    except OSError as exc:
        logger.warning("could not write the %s copy of %s: %s", dtype, model_dir, exc)
        return None
    logger.info("wrote the %s copy of the weights of %s", dtype, model_dir)
    return typed


class DummyLoader(ModelLoader):
    """Random weights with the shapes config.json describes, for profiling and tests."""

    def load(self, model: nn.Module, model_dir: Path) -> None:
        generator = torch.Generator().manual_seed(0)
        std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * std)
