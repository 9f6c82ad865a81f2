"""Built-in grammar plugins (`--grammar-backend`): xgrammar, llguidance and outlines, each
available when its package is installed, and `none`, which turns constrained decoding off."""

from srv.sdk import hookimpl, requires_packages

SRV_SDK_VERSION = ">=0.1,<0.2"


@hookimpl
def srv_register_grammar_backends(register):
    register("xgrammar", "srv.plugins.grammar.xgrammar_backend:XGrammarBackend",
             description="xgrammar: JSON schema, regex and EBNF with cached token masks",
             available=requires_packages("xgrammar"), priority=30)
    register("llguidance", "srv.plugins.grammar.llguidance_backend:LLGuidanceBackend",
             description="llguidance: JSON schema, regex and EBNF (GBNF or Lark), masks computed on demand",
             available=requires_packages("llguidance"), priority=20)
    register("outlines", "srv.plugins.grammar.outlines_backend:OutlinesBackend",
             description="outlines-core: JSON schema and regex compiled to a token automaton (no EBNF)",
             available=requires_packages("outlines_core"), priority=10)
    register("none", "srv.plugins.grammar.disabled:DisabledGrammarBackend",
             description="constrained decoding off: requests with a json_schema, regex or ebnf get a 400",
             priority=0)
