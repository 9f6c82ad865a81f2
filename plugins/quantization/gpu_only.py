"""The factory of the GPU-only methods: their availability checks refuse them first, so it is
reached only by a caller that skips the check."""

from srv.sdk.quantization import QuantizationMethod


class GPUOnlyQuantization(QuantizationMethod):
    def __init__(self, server_args=None) -> None:
        raise RuntimeError("this quantization method runs only on a GPU (see `srv plugins`)")
