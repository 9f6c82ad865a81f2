"""Conformance kits for weight loaders (`--load-format`) and model implementations (`--model-impl`).

Both run `srv.Engine` on a tiny random model and compare its greedy tokens with Hugging Face
transformers' on the same weights (eos ignored, so every prompt gives `new_tokens` tokens).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from srv.sdk.models import ModelConfig, ModelImpl, ModelLoader, materialize
from srv.sdk.testing.registry import create, registered_temporarily, registration
from srv.sdk.testing.tiny_model import hf_greedy, random_prompts, tiny_llama, write_tiny_llama

#: The name a backend given only by its factory is registered under while an engine starts.
TEMPORARY_NAME = "srv-sdk-testing"


@contextlib.contextmanager
def _engine_backend(kit: Any, family: str, name_attr: str, factory_attr: str) -> Iterator[str]:
    """The name to pass to srv.Engine: the kit's backend_name, or its factory registered temporarily."""
    factory = getattr(type(kit), factory_attr, None)
    if factory is None:
        name = getattr(type(kit), name_attr, None)
        if name is None:
            raise TypeError(f"{type(kit).__name__}: set {name_attr} (a registered name) or {factory_attr}")
        registration(family, name)  # skips the test if the backend is unavailable here
        yield name
    else:
        with registered_temporarily(family, TEMPORARY_NAME, factory) as name:
            yield name


class _EngineChecks:
    new_tokens: int = 8
    prompt_lengths: list[int] = [3, 17, 40, 9, 1]

    def assert_greedy_matches(self, engine: Any, reference: Any, prompts: list[list[int]]) -> list[dict]:
        greedy = {"max_new_tokens": self.new_tokens, "temperature": 0, "ignore_eos": True}
        results = engine.generate(input_ids=prompts, sampling_params=greedy)
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            expected = hf_greedy(reference, prompt, self.new_tokens)
            assert result["output_ids"] == expected, (
                f"prompt {i} (length {len(prompt)}): srv {result['output_ids']} != transformers {expected}")
        return results


class ModelLoaderKit(_EngineChecks):
    """Checks a weight loader: it recognises its checkpoint, `prepare` gives a Hugging Face style
    directory, `load` fills every parameter of srv's native model with the checkpoint's
    weights, and `srv.Engine(load_format=...)` then generates transformers' greedy tokens.

        class TestMyLoader(ModelLoaderKit):
            backend_name = "my_format"           # the name your plugin registers, or:
            # loader_factory = MyLoader          # (server_args) -> ModelLoader

            def make_checkpoint(self, tmp_path):
                # save self.reference_model() (a tiny transformers Llama) in your format, with
                # its config and a tokenizer (srv.sdk.testing.save_tiny_tokenizer), and return
                # the path users would pass as --model-path
                ...

    The default `make_checkpoint` writes safetensors (what the "safetensors" loader reads).
    auto_detect: whether `accepts` must claim the checkpoint (`--load-format auto`);
    weight_atol: how far loaded weights may be from the reference's (0 for lossless formats).
    """

    backend_name: str | None = None
    loader_factory: Callable[..., ModelLoader] | None = None
    server_args: Any = None
    auto_detect: bool = True
    weight_atol: float = 0.0
    engine_flags: dict[str, Any] = {"max_total_tokens": 4096}

    def make_loader(self) -> ModelLoader:
        return create(self, "load_format", "backend_name", "loader_factory", self.server_args)

    def reference_model(self) -> Any:
        """The transformers model whose weights the checkpoint holds."""
        return tiny_llama()

    def make_checkpoint(self, tmp_path: Path) -> Path:
        return write_tiny_llama(tmp_path / "model", model=self.reference_model())

    # Class-scoped fixtures (one checkpoint and one engine per kit subclass) are classmethods.
    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_checkpoint(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return Path(cls().make_checkpoint(tmp_path_factory.mktemp("checkpoint")))

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_engine(cls, srv_kit_checkpoint: Path) -> Iterator[Any]:
        from srv import Engine  # lazily: the public entry point, and all of srv's core behind it

        with _engine_backend(cls(), "load_format", "backend_name", "loader_factory") as name:
            engine = Engine(model_path=str(srv_kit_checkpoint), load_format=name, dtype="float32",
                            **cls.engine_flags)
        try:
            yield engine
        finally:
            engine.shutdown()

    def build_native_model(self, config: Any) -> torch.nn.Module:
        """srv's native model for `config`, built as srv builds it, every parameter NaN.

        (On the meta device, then given empty storage, as the model runner does.)"""
        impl = registration("model_impl", "srv").create(self.server_args)
        assert impl.supports(config), f"srv's native implementation does not support {config.architectures}"
        with torch.device("meta"):
            model = impl.build(config)
        model = materialize(model)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan"))
        return model

    # ---- the tests -------------------------------------------------------------------------

    def test_accepts_its_checkpoint(self, srv_kit_checkpoint: Path) -> None:
        if not self.auto_detect:
            pytest.skip("auto_detect = False: this loader is only chosen by name")
        assert self.make_loader().accepts(srv_kit_checkpoint), f"accepts() refused {srv_kit_checkpoint}"

    def test_rejects_an_empty_directory(self, tmp_path: Path) -> None:
        assert not self.make_loader().accepts(tmp_path), "accepts() claimed an empty directory"

    def test_prepare_returns_a_model_directory(self, srv_kit_checkpoint: Path) -> None:
        model_dir = Path(self.make_loader().prepare(srv_kit_checkpoint))
        assert (model_dir / "config.json").is_file(), f"prepare() gave {model_dir}, which has no config.json"
        config = ModelConfig.read(model_dir)
        assert config.vocab_size == self.reference_model().config.vocab_size, "prepare() gave another model's config"

    def test_load_fills_srv_native_model(self, srv_kit_checkpoint: Path) -> None:
        loader = self.make_loader()
        model_dir = Path(loader.prepare(srv_kit_checkpoint))
        config = ModelConfig.read(model_dir)
        model = self.build_native_model(config)
        loader.load(model, model_dir)
        expected = self.build_native_model(config)
        expected.load_weights(self.reference_model().state_dict().items())
        actual = dict(model.named_parameters())
        wrong = [name for name, want in expected.named_parameters()
                 if not torch.allclose(actual[name].float(), want.float(), atol=self.weight_atol, rtol=0)]
        assert not wrong, f"load() left these parameters unset or wrong: {wrong}"

    def test_engine_greedy_matches_transformers(self, srv_kit_engine: Any) -> None:
        reference = self.reference_model()
        prompts = random_prompts(self.prompt_lengths, reference.config.vocab_size, seed=1)
        self.assert_greedy_matches(srv_kit_engine, reference, prompts)


class ModelImplKit(_EngineChecks):
    """Checks a model implementation: it supports its model, builds on the meta device, and
    `srv.Engine(model_impl=...)` generates transformers' greedy tokens, batched, in pages of
    16 with prefill chunks of 16, and on prefix-cache hits.

        class TestMyModels(ModelImplKit):
            backend_name = "my_impl"             # the name your plugin registers, or:
            # impl_factory = MyModels            # (server_args) -> ModelImpl

            def make_model_dir(self, tmp_path):  # default: a tiny random Llama
                # save a tiny random transformers model of an architecture you support, with a
                # tokenizer (srv.sdk.testing.save_tiny_tokenizer), and return the directory
                ...
    """

    backend_name: str | None = None
    impl_factory: Callable[..., ModelImpl] | None = None
    server_args: Any = None
    engine_flags: dict[str, Any] = {"page_size": 16, "chunked_prefill_size": 16, "max_total_tokens": 4096}

    def make_impl(self) -> ModelImpl:
        return create(self, "model_impl", "backend_name", "impl_factory", self.server_args)

    def make_model_dir(self, tmp_path: Path) -> Path:
        return write_tiny_llama(tmp_path / "model")

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_model_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return Path(cls().make_model_dir(tmp_path_factory.mktemp("model")))

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_reference(cls, srv_kit_model_dir: Path) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(srv_kit_model_dir), dtype=torch.float32).eval()

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_engine(cls, srv_kit_model_dir: Path) -> Iterator[Any]:
        from srv import Engine  # lazily: the public entry point, and all of srv's core behind it

        with _engine_backend(cls(), "model_impl", "backend_name", "impl_factory") as name:
            engine = Engine(model_path=str(srv_kit_model_dir), model_impl=name, dtype="float32",
                            **cls.engine_flags)
        try:
            yield engine
        finally:
            engine.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def srv_kit_tp_engine(cls, srv_kit_model_dir: Path) -> Iterator[Any]:
        """An engine at --tensor-parallel-size 2. Skipped for an implementation that does not
        declare `tensor_parallel`, and for one given only as a factory: the second rank is
        another process, which finds backends among the installed plugins."""
        from srv import Engine

        impl = cls().make_impl()
        if not impl.tensor_parallel:
            pytest.skip(f"{type(impl).__name__} does not declare tensor_parallel (srv refuses --tensor-parallel-size > 1)")
        if cls.impl_factory is not None or cls.backend_name is None:
            pytest.skip("the implementation is given as a factory: tensor-parallel ranks run in other processes, "
                        "which need an installed plugin (set backend_name)")
        registration("model_impl", cls.backend_name)
        engine = Engine(model_path=str(srv_kit_model_dir), model_impl=cls.backend_name, dtype="float32",
                        tensor_parallel_size=2, **cls.engine_flags)
        try:
            yield engine
        finally:
            engine.shutdown()

    def config(self, model_dir: Path) -> ModelConfig:
        return ModelConfig.read(model_dir)

    # ---- the tests -------------------------------------------------------------------------

    def test_supports_its_model(self, srv_kit_model_dir: Path) -> None:
        config = self.config(srv_kit_model_dir)
        assert self.make_impl().supports(config), f"supports() is False for {config.architectures}"

    def test_builds_on_the_meta_device(self, srv_kit_model_dir: Path) -> None:
        with torch.device("meta"):
            model = self.make_impl().build(self.config(srv_kit_model_dir))
        assert isinstance(model, torch.nn.Module), f"build() returned {type(model).__name__}, not an nn.Module"
        assert callable(getattr(model, "load_weights", None)), "the model has no load_weights(named_tensors)"

    def test_batched_greedy_matches_transformers(self, srv_kit_engine: Any, srv_kit_reference: Any) -> None:
        prompts = random_prompts(self.prompt_lengths, srv_kit_reference.config.vocab_size, seed=2)
        self.assert_greedy_matches(srv_kit_engine, srv_kit_reference, prompts)

    def test_prefix_cache_hits_match_transformers(self, srv_kit_engine: Any, srv_kit_reference: Any) -> None:
        shared = random_prompts([40], srv_kit_reference.config.vocab_size, seed=3)[0]
        self.assert_greedy_matches(srv_kit_engine, srv_kit_reference, [shared + [5]])
        second = self.assert_greedy_matches(srv_kit_engine, srv_kit_reference, [shared + [6, 7, 8], shared[:20]])
        assert second[0]["meta_info"]["cached_tokens"] > 0, "the second request found no cached prefix"

    def test_hidden_states_match_transformers(self, srv_kit_model_dir: Path, srv_kit_reference: Any) -> None:
        """ForwardBatch.capture_layers: the residual stream entering the layers asked, and the
        final norm's output, for every new token, as transformers' output_hidden_states."""
        from safetensors.torch import load_file

        from srv.sdk.attention import ForwardBatch, KVCache

        config = self.config(srv_kit_model_dir)
        impl = self.make_impl()
        model = impl.build(config)
        weights = {}
        for path in sorted(srv_kit_model_dir.glob("*.safetensors")):
            weights.update(load_file(str(path)))
        model.load_weights(weights.items())
        model.float().eval()
        impl.finalize(model)
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layers = config.num_hidden_layers
        [prompt] = random_prompts([11], config.vocab_size, seed=5)
        n = len(prompt)
        slots = torch.arange(1, n + 1)
        attention = registration("attention", "torch_native").create(heads, kv_heads, head_dim, head_dim ** -0.5)
        capture = (0, layers - 1, layers)
        batch = ForwardBatch(input_ids=torch.tensor(prompt), positions=torch.arange(n), out_cache_loc=slots,
                             kv_slots=slots[None], prefix_lens=[0], extend_lens=[n],
                             kv_cache=KVCache(n + 1, layers, kv_heads, head_dim, torch.float32), attention=attention,
                             capture_layers=capture)
        out = model(batch)
        hidden = out.hidden_states if hasattr(out, "hidden_states") else None
        assert hidden is not None and hidden.shape == (n, len(capture) * config.hidden_size), \
            "the model must return ModelOutput.hidden_states [new tokens, layers asked x hidden]"
        with torch.inference_mode():
            expected = srv_kit_reference(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        for j, i in enumerate(capture):
            torch.testing.assert_close(hidden[:, j * config.hidden_size:(j + 1) * config.hidden_size],
                                       expected[i][0].float(), atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"hidden states {i} of {layers}: {m}")

    def test_prompt_logprobs_match_transformers(self, srv_kit_engine: Any, srv_kit_reference: Any) -> None:
        """The model returns the logits of the rows `ForwardBatch.logits_rows()` names: a
        prompt's log-probabilities (logprob_start_len, prefill chunks of 16) are transformers'."""
        [prompt] = random_prompts([37], srv_kit_reference.config.vocab_size, seed=4)
        result = srv_kit_engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 1, "temperature": 0, "logprobs": True, "logprob_start_len": 0})
        got = result["meta_info"]["input_token_logprobs"]
        assert [token for _, token in got] == prompt and got[0][0] is None, \
            "one log-probability a prompt token, None for the first"
        with torch.inference_mode():
            logits = srv_kit_reference(torch.tensor([prompt])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor([lp for lp, _ in got[1:]]), expected, atol=1e-4, rtol=0)

    def test_tensor_parallel_greedy_matches_transformers(self, srv_kit_tp_engine: Any,
                                                         srv_kit_reference: Any) -> None:
        """`--tensor-parallel-size 2`: two ranks, each building its share of the model
        (`ModelImpl.parallel`), give transformers' greedy tokens (see srv_kit_tp_engine for when
        it is skipped)."""
        prompts = random_prompts(self.prompt_lengths[:3], srv_kit_reference.config.vocab_size, seed=5)
        self.assert_greedy_matches(srv_kit_tp_engine, srv_kit_reference, prompts)

    def test_idle_pass_computes_nothing(self, srv_kit_engine: Any) -> None:
        """An IDLE pass (`ForwardMode.IDLE`, what a data-parallel attention rank with nothing to
        compute runs beside the others): no rows in, no logits out, nothing stored in the KV
        cache. Skipped for an implementation that does not declare `tensor_parallel`."""
        from srv.sdk.attention import ForwardBatch

        if not self.make_impl().tensor_parallel:
            pytest.skip("the implementation does not declare tensor_parallel (srv refuses --enable-dp-attention)")
        runner = srv_kit_engine.runner
        cache = runner.kv_cache
        stored: list[int] = []
        cache.store = lambda layer_id, *rest: stored.append(layer_id)
        try:
            with torch.inference_mode():
                out = runner.model(ForwardBatch.idle(cache, runner.decode_attention))
        finally:
            del cache.store
        assert not stored, "an IDLE pass stored keys and values"
        logits = out.logits if hasattr(out, "logits") else out
        assert logits.shape[0] == 0, "an IDLE pass returns no logits rows"
