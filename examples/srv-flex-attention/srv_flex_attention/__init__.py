"""srv plugin: the `flex_attention` attention backend."""

from srv.sdk import hookimpl, requires_packages

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_attention_backends(register):
    register("flex_attention", "srv_flex_attention.backend:FlexAttention",
             description="PyTorch flex_attention over the ragged batch with a per-request causal mask",
             available=requires_packages("torch.nn.attention.flex_attention"))
