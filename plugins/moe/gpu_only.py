"""The factories of the accelerator-only MoE backends: their availability checks refuse them
first, so these are reached only by a caller that skips the check."""

from srv.sdk.moe import MoEDispatcher, MoERunner


class GPUOnlyRunner(MoERunner):
    def __init__(self, server_args=None) -> None:
        raise RuntimeError("this MoE runner runs only on a GPU (see `srv plugins`)")

    def run(self, x, weights, ids, experts):
        raise NotImplementedError


class GPUOnlyDispatcher(MoEDispatcher):
    def __init__(self, server_args=None) -> None:
        raise RuntimeError("this MoE all-to-all backend runs only on an accelerator (see `srv plugins`)")

    def dispatch(self, x, weights, ids, experts, parallel):
        raise NotImplementedError

    def combine(self, out, dispatched, parallel):
        raise NotImplementedError
