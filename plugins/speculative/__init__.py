"""Speculative decoding algorithms (`--speculative-algorithm`)."""

from srv.sdk import hookimpl

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_speculative_algorithms(register):
    register("NGRAM", "srv.plugins.speculative.ngram:NgramAlgorithm",
             description="drafts what followed the request's latest tokens earlier in its prompt and output "
                         "(no draft model)")
    register("EAGLE", "srv.plugins.speculative.eagle:EagleAlgorithm",
             description="an EAGLE head (--speculative-draft-model-path) drafts from the target's last hidden state")
    register("NEXTN", "srv.plugins.speculative.eagle:EagleAlgorithm",
             description="SGLang's name for EAGLE with a model's own next-token head")
    register("EAGLE3", "srv.plugins.speculative.eagle:Eagle3Algorithm",
             description="an EAGLE3 head drafts from three of the target's layers' hidden states")
    register("STANDALONE", "srv.plugins.speculative.standalone:StandaloneAlgorithm",
             description="a smaller model of the same vocabulary drafts greedily "
                         "(--speculative-draft-model-path)")
