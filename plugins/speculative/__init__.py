"""Speculative decoding algorithms (`--speculative-algorithm`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_speculative_algorithms(register):
    register("NGRAM", "srv.plugins.speculative.ngram:NgramAlgorithm",
             description="drafts what followed the request's latest tokens earlier in its prompt and output "
                         "(no draft model)")
    register("STANDALONE", "srv.plugins.speculative.standalone:StandaloneAlgorithm",
             description="a smaller model of the same vocabulary drafts greedily "
                         "(--speculative-draft-model-path)")
