"""Layers split across tensor-parallel ranks (see srv.sdk.parallel), for model implementations.

Each is the plain torch layer of this rank's shape (an `nn.Linear`, an `nn.Embedding`), so the
slots that serve a linear layer's weights (a quantization method's `Linear`, a packed layer)
take its place as they take any linear layer's. What makes it parallel travels with it as its
`sharding`: which checkpoint rows or columns this rank holds. The model loads a checkpoint
tensor through `load_shard`, which cuts this rank's part, and calls the collective a layer needs
after it, whatever module serves it:

    ColumnParallelLinear      output features split: each rank's output is its own columns
    MergedColumnParallelLinear several projections fused (gate and up), each split
    QKVParallelLinear         query, key and value heads split by key/value head groups
    RowParallelLinear         input features split: each rank's output is a partial sum that
                              the model adds up with `parallel.all_reduce`
    VocabParallelEmbedding    vocabulary rows split; the lookup adds up the ranks' rows itself
    ParallelLMHead            vocabulary split: the model puts the logits together where they
                              are sampled with `parallel.vocab_logits(head, x, head.vocab_starts)`

Under data-parallel attention a model runs each feed-forward block (an MLP, a sparse block) on
every rank's rows with `parallel.run_gathered(block, x)`, and builds its attention layers with
`parallel.attention`.

At tp=1 each is its torch layer and `load_shard` copies the whole tensor. A sparse block's
experts are `srv.sdk.moe.FusedMoE` (split by expert across `--ep-size` groups, and by feature
within one), run by the launch's MoE runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from srv.sdk.linear import load_weight
from srv.sdk.parallel import ParallelContext


@dataclass
class Sharding:
    """This rank's part of a layer's checkpoint tensors: along `dim` (0: output features, 1:
    input features), for each checkpoint shard (query, key, value; gate, up; or the one tensor)
    the (start, size) it takes of that tensor. `rank` is the tensor-parallel rank: the bias of
    an input-split layer is added once, by rank 0."""

    dim: int
    ranges: list[tuple[int, int]]
    rank: int = 0
    ranks: int = 1

    def cut(self, tensor: torch.Tensor, shard: int = 0) -> torch.Tensor:
        """This rank's part of checkpoint shard `shard`'s tensor (all of it with one rank)."""
        if self.ranks == 1:
            return tensor
        start, size = self.ranges[shard]
        if self.dim == 1 and tensor.dim() == 1:   # an input-split layer's bias
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if tensor.dim() <= self.dim or tensor.shape[self.dim] < start + size:
            raise ValueError(f"a checkpoint tensor of shape {list(tensor.shape)} has no [{start}, {start + size}) "
                             f"along dimension {self.dim} for tensor-parallel rank {self.rank}")
        return tensor.narrow(self.dim, start, size)

    def local_offsets(self) -> list[int]:
        """Where each shard starts in this rank's output features (dim 0)."""
        offsets = [0]
        for _, size in self.ranges:
            offsets.append(offsets[-1] + size)
        return offsets


def load_shard(name: str, module: nn.Module, param: torch.Tensor, rows: torch.Tensor, tensor: torch.Tensor,
               shard: int = 0) -> None:
    """Fill `rows` of `param` (a parameter of `module`, or its rows for checkpoint shard `shard`)
    from this rank's part of the checkpoint's `tensor`."""
    load_weight(name, param, rows, rank_part(module, tensor, shard))


def rank_part(module: nn.Module, tensor: torch.Tensor, shard: int = 0) -> torch.Tensor:
    """This rank's part of the checkpoint's `tensor` (of checkpoint shard `shard`) for `module`:
    all of it where the module does not split."""
    sharding = getattr(module, "sharding", None)
    return tensor if sharding is None else sharding.cut(tensor, shard)


def _split(layer: nn.Module, sharding: Sharding) -> None:
    layer.sharding = sharding


class ColumnParallelLinear(nn.Linear):
    """y[:, this rank's columns] = x W^T: the output features split across ranks, in units of
    `unit` (a head's features, say)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext,
                 unit: int = 1) -> None:
        start, size = parallel.partition(out_features, unit)
        super().__init__(in_features, size, bias=bias)
        _split(self, Sharding(0, [(start, size)], parallel.tp_rank, parallel.tp_size))


class MergedColumnParallelLinear(nn.Linear):
    """Several column-parallel projections of one input fused into one product (gate and up):
    each rank holds its part of each, side by side."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, parallel: ParallelContext,
                 unit: int = 1) -> None:
        ranges = [parallel.partition(size, unit) for size in output_sizes]
        super().__init__(in_features, sum(size for _, size in ranges), bias=bias)
        _split(self, Sharding(0, ranges, parallel.tp_rank, parallel.tp_size))


class QKVParallelLinear(nn.Linear):
    """Query, key and value projections fused, split by key/value head: a rank holds some
    key/value heads and the query heads that attend with them (`num_heads`, `num_kv_heads` are
    this rank's)."""

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int, bias: bool,
                 parallel: ParallelContext) -> None:
        if total_heads % total_kv_heads:
            raise ValueError(f"{total_heads} query heads do not share {total_kv_heads} key/value heads evenly")
        group = total_heads // total_kv_heads
        kv_start, kv_heads = parallel.partition(total_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = kv_heads * group, kv_heads, head_dim
        ranges = [(kv_start * group * head_dim, kv_heads * group * head_dim),
                  (kv_start * head_dim, kv_heads * head_dim), (kv_start * head_dim, kv_heads * head_dim)]
        super().__init__(hidden_size, (self.num_heads + 2 * kv_heads) * head_dim, bias=bias)
        _split(self, Sharding(0, ranges, parallel.tp_rank, parallel.tp_size))


class RowParallelLinear(nn.Linear):
    """y = x[:, this rank's features] W[:, those]^T, a partial sum: the model adds the ranks'
    outputs with `parallel.all_reduce`. `unit` must cut the input as the layer before cut its
    output (a key/value head group's query features for the attention output)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext,
                 unit: int = 1) -> None:
        start, size = parallel.partition(in_features, unit)
        super().__init__(size, out_features, bias=bias)
        _split(self, Sharding(1, [(start, size)], parallel.tp_rank, parallel.tp_size))


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds the rows of a range of the vocabulary; a token's row comes from the rank
    that holds it (the others add zeros)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelContext) -> None:
        self.vocab_starts = parallel.partition_starts(num_embeddings)
        start, size = parallel.partition(num_embeddings)
        # Given its (empty) weight: Embedding's own random init on the meta device imports
        # torch._dynamo, a second of every launch.
        super().__init__(size, embedding_dim, _weight=torch.empty(size, embedding_dim))
        self.parallel, self.vocab_start = parallel, start
        _split(self, Sharding(0, [(start, size)], parallel.tp_rank, parallel.tp_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_parallel:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(ColumnParallelLinear):
    """The vocabulary head, split by vocabulary range as VocabParallelEmbedding is (a tied head
    takes the same rows of the embedding matrix)."""

    def __init__(self, hidden_size: int, vocab_size: int, parallel: ParallelContext) -> None:
        super().__init__(hidden_size, vocab_size, False, parallel)
        self.vocab_starts = parallel.partition_starts(vocab_size)


class Float32Head(nn.Module):
    """A vocabulary head computing in float32 (`--enable-fp32-lm-head`) for a model served in
    another dtype: the rows widened to float32, and a plain head's weights widened once (a copy:
    a tied head shares its weights with the embedding, which stays in the served dtype); a
    quantized head (any module without a floating-point `weight`) takes the float32 rows and
    returns its float32 product unrounded. `weight` is what the product reads."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head
        weight = getattr(head, "weight", None)
        plain = isinstance(weight, torch.Tensor) and weight.is_floating_point()
        self.weight = weight.detach().float() if plain else weight
        bias = getattr(head, "bias", None) if plain else None
        self.bias = bias.detach().float() if isinstance(bias, torch.Tensor) else None
        self.plain = plain
        self.vocab_starts = getattr(head, "vocab_starts", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return F.linear(x.float(), self.weight, self.bias)
        return self.head(x.float()).float()


def use_float32_head(model: nn.Module) -> None:
    """Put a Float32Head in place of `model`'s vocabulary head: the module a transformers model's
    `get_output_embeddings()` names, else the one called `lm_head`, wherever it sits."""
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if head is not None:
            module.set_output_embeddings(Float32Head(head))
            return
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "lm_head":
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, "lm_head", Float32Head(module))
            return
    raise ValueError(f"--enable-fp32-lm-head: {type(model).__name__} has no vocabulary head srv can find "
                     "(an `lm_head` module, or transformers' get_output_embeddings)")
