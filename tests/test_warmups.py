"""--warmups: srv's warm-up plugins pass their kit, run before the server listens, and an
unknown name is refused at launch."""

from __future__ import annotations

import pytest

from srv.args.parser import parse_launch_args
from srv.plugin_manager import load_plugins
from srv.sdk.testing import WarmupKit
from test_server import served_once


class TestLongPrefillKit(WarmupKit):
    warmup_name = "long_prefill"


class TestDecodeBatchKit(WarmupKit):
    warmup_name = "decode_batch"


def test_the_server_runs_its_warmups_before_it_listens(tiny_models):
    lines = served_once("--model-path", str(tiny_models["llama"]), "--warmups", "long_prefill,decode_batch")
    done = [lines.index(f"warm-up {name} done") for name in ("long_prefill", "decode_batch")]
    assert done == sorted(done) and max(done) < lines.index("serving ")


def test_an_unknown_warmup_is_refused_at_launch(capsys):
    with pytest.raises(SystemExit):
        parse_launch_args(["--warmups", "long_prefill,no_such_warmup"], *load_plugins())
    assert "--warmups: unknown warmup backend 'no_such_warmup'" in capsys.readouterr().err
