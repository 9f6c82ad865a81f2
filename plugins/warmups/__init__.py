"""Warm-ups a server runs before it listens (`--warmups long_prefill,decode_batch`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_warmups(register):
    register("long_prefill", "srv.plugins.warmups.builtin:LongPrefill",
             description="one prompt of a full prefill chunk: the products and attention of long prompts, "
                         "and their one-time layouts, before a user's long prompt needs them")
    register("decode_batch", "srv.plugins.warmups.builtin:DecodeBatch",
             description="every batch size up to 16 (or --max-running-requests) decoding a few tokens: the "
                         "decode kernels each batch size uses, built before the first batches")
