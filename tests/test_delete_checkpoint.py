"""--delete-ckpt-after-loading: once every rank has loaded it (after the warm-up), the checkpoint
--model-path names is deleted and the server serves on; the embedded default is never deleted."""

from __future__ import annotations

import shutil

import pytest

import srv
from srv.args.parser import parse_launch_args
from srv.plugin_manager import load_plugins
from test_server import served_once


def test_the_checkpoint_is_deleted_once_loaded_and_the_server_serves_on(tiny_models, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], copy)
    output = served_once("--model-path", str(copy), "--delete-ckpt-after-loading")   # answers after the deletion
    assert not copy.exists() and "deleted the checkpoint" in output


@pytest.mark.parametrize("flags,message", [
    ([], "the embedded default model is not deleted"),
    (["--model-path", "x", "--tp-size", "2", "--skip-server-warmup"], "cannot be combined with --skip-server-warmup"),
])
def test_a_deletion_srv_cannot_make_safely_is_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_launch_args([*flags, "--delete-ckpt-after-loading"], *load_plugins())
    assert message in capsys.readouterr().err


def test_the_in_process_engine_leaves_deletion_to_its_caller(tiny_models):
    with pytest.raises(ValueError, match="srv.Engine has none"):
        srv.Engine(model_path=str(tiny_models["llama"]), delete_ckpt_after_loading=True)
