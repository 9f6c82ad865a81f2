"""Model, KV memory and scheduler for a launch's arguments: what the scheduler process and the
offline `srv.Engine` both build. The scheduler process imports this on its way to building the
model, so it stays clear of the HTTP side's modules (pydantic, the front end)."""

from __future__ import annotations

import functools
import os
from argparse import Namespace
from pathlib import Path
from typing import Callable

import torch

from srv.backend_registry import BackendRegistry
from srv.engine.model_runner import ModelRunner
from srv.engine.scheduler import Scheduler
from srv.engine.tokenizer import load_tokenizer


def choose_torch_threads(args: Namespace) -> None:
    """One torch thread per core this process may run on, unless OMP_NUM_THREADS says otherwise;
    the cores are shared among the processes that compute at once (data-parallel groups, and
    the tensor-parallel ranks on this machine: srv.engine.layout.torch_threads).

    On the 2-core machines every batch size decoded faster on two threads than on one, also
    with the other core kept busy by another process, so no fewer are taken. Tests that run a
    client beside the server set OMP_NUM_THREADS=1.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        from srv.engine.layout import torch_threads

        torch.set_num_threads(torch_threads(args))


def build_scheduler(args: Namespace, registry: BackendRegistry,
                    on_model_dir: Callable[[Path], None] | None = None) -> tuple[ModelRunner, Scheduler]:
    """Model, KV memory and scheduler for `args`; `on_model_dir` hears of the model directory
    before the weights load. The tokenizer loads later (see Scheduler.set_tokenizer_loader)."""
    choose_torch_threads(args)
    if args.random_seed is not None:
        # Unseeded sampling draws from torch's global generator: --random-seed fixes it.
        torch.manual_seed(args.random_seed)
    runner = ModelRunner(args, registry, on_model_dir=on_model_dir)
    try:
        scheduler = Scheduler(args, runner, registry)
    except BaseException:
        runner.close()   # the other ranks it started, and its place in their group
        raise
    if not args.skip_tokenizer_init:
        scheduler.set_tokenizer_loader(functools.partial(load_tokenizer, args, str(runner.model_dir)))
    return runner, scheduler
