"""Built-in sampler plugin: the PyTorch sampler (`--sampling-backend pytorch`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_sampling_backends(register):
    register("pytorch", "srv.plugins.sampling.pytorch_sampler:PyTorchSampler",
             description="batched PyTorch sampler: penalties, temperature, top-k/top-p/min-p, seeds, logprobs",
             priority=10)
