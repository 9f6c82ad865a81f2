"""`--debug-tensor-dump-output-folder`: every forward pass's layer outputs, saved for comparing
a run with another (another backend, another build, a reference implementation).

Forward hooks note the output of the embedding, of each decoder layer (`...layers.<i>`), of the
final norm and of the head; after each pass of the whole model they are written to
`<folder>/TP<rank>_PP<stage>/pass<n>.pt` (n from 0), one `torch.save`d dict of module name to
tensor (a layer returning several tensors, as the native layers return (hidden, residual), gives
`name.0`, `name.1`). Outputs are copied as they come, so later in-place updates do not reach the
dump. Being hooks, they keep the model on its Python path (see srv.engine.forward_hooks).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("srv.engine")

# The modules dumped, by the last parts of their names.
DUMPED = re.compile(r"(^|\.)(embed_tokens|layers\.\d+|norm|lm_head)$")


class TensorDumper:
    def __init__(self, model: nn.Module, folder: str, tp_rank: int = 0, pp_rank: int = 0) -> None:
        self.folder = Path(folder) / f"TP{tp_rank}_PP{pp_rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.passes = 0
        self.tensors: dict[str, torch.Tensor] = {}
        names = [name for name, _ in model.named_modules() if DUMPED.search(name)]
        if not names:
            raise ValueError(f"--debug-tensor-dump-output-folder: {type(model).__name__} has no module named like "
                             "embed_tokens, layers.<i>, norm or lm_head to dump")
        for name in names:
            model.get_submodule(name).register_forward_hook(self._note(name))
        model.register_forward_hook(self._write)
        logger.info("dumping %d modules' outputs of every forward pass into %s", len(names), self.folder)

    def _note(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                self.tensors[name] = output.detach().clone()
            elif isinstance(output, (tuple, list)):
                for i, part in enumerate(output):
                    if isinstance(part, torch.Tensor):
                        self.tensors[f"{name}.{i}"] = part.detach().clone()
        return hook

    def _write(self, module: nn.Module, inputs: Any, output: Any) -> None:
        torch.save(self.tensors, self.folder / f"pass{self.passes:05d}.pt")
        self.passes += 1
        self.tensors = {}
