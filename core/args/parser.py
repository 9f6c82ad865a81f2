"""The `srv launch` parser: the flag table, plugin flags, backend names from the registry,
config files, and the checks that make unfinished or deprecated flags fail loudly."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from srv.args.flags import FlagSpec, load_flag_specs
from srv.args.unsupported import NOT_SUPPORTED_YET
from srv.backend_registry import AUTO, NONE, BackendError, BackendRegistry
from srv.plugin_manager import PluginManager


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None


VALUE_TYPES = {"str": str, "int": int, "float": float, "json": json_value}


class BackendName:
    """An argparse type accepting the names a family's registry holds (and "auto" where allowed).

    The documented default passes unchecked: it is only validated when a feature uses it.
    """

    def __init__(self, registry: BackendRegistry, spec: FlagSpec) -> None:
        self.registry, self.spec = registry, spec
        self.__name__ = f"{spec.family} backend"

    def names(self) -> list[str]:
        return ([AUTO] if self.spec.auto else []) + ([NONE] if self.spec.none else []) \
            + self.registry.names(self.spec.family or "")

    def __call__(self, value: str) -> str:
        if value == self.spec.default or value in self.names():
            return value
        try:
            self.registry.get(self.spec.family or "", value)
        except BackendError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value


class LaunchArgumentParser(argparse.ArgumentParser):
    def __init__(self, registry: BackendRegistry, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.registry = registry
        self.given: set[str] = set()   # the dests the last parse's tokens named (config file included)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        tokens = list(sys.argv[1:] if args is None else args)
        options = {option: action.dest for action in self._actions for option in action.option_strings}
        self.given = {options[token.split("=", 1)[0]] for token in tokens
                      if token.startswith("--") and token.split("=", 1)[0] in options}
        return super().parse_known_args(tokens, namespace)

    def defaults(self) -> dict[str, Any]:
        """Every flag's value where none is given, typed as a parse types it (`given` unchanged)."""
        return vars(super().parse_known_args([])[0])


def build_launch_parser(manager: PluginManager, registry: BackendRegistry) -> LaunchArgumentParser:
    parser = LaunchArgumentParser(
        registry,
        prog="srv launch",
        usage="%(prog)s [--model-path PATH] [--config FILE.yaml] [FLAG ...]  (srv launch --help lists all)",
        description="Serve a language model over an OpenAI-compatible HTTP API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in load_flag_specs():
        group = groups.get(spec.section) or groups.setdefault(spec.section, parser.add_argument_group(spec.section))
        _add_flag(group, spec, registry)
    manager.add_launch_arguments(parser)
    # Not a flag: which data-parallel group a scheduler serves (spawn_scheduler_processes sets it).
    parser.set_defaults(data_parallel_rank=0)
    return parser


def _add_flag(group: argparse._ArgumentGroup, spec: FlagSpec, registry: BackendRegistry) -> None:
    kwargs: dict[str, Any] = {"dest": spec.dest, "default": spec.default, "help": spec.help.replace("%", "%%")}
    if spec.type == "bool":
        kwargs["action"] = "store_true"
    else:
        kwargs["type"] = VALUE_TYPES[spec.type]
        if spec.nargs:
            kwargs["nargs"] = spec.nargs
        if spec.choices:
            kwargs["choices"] = spec.choices
        if spec.family:
            name_type = BackendName(registry, spec)
            kwargs["type"] = name_type
            kwargs["metavar"] = "{" + ",".join(name_type.names()) + "}"
    group.add_argument(*spec.names, **kwargs)


def options_to_argv(options: Mapping[str, Any], parser: argparse.ArgumentParser, origin: str) -> list[str]:
    """Turn `{"page-size": 16, "enable_metrics": True}` into the command-line tokens that mean it.

    Keys may use dashes or underscores and may be any alias of a flag; an unknown key is an
    error naming it. Going through the command line keeps one path for types and choices.
    """
    actions = {opt: action for action in parser._actions for opt in action.option_strings}
    argv: list[str] = []
    for key, value in options.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None or option in ("--help", "--config"):
            parser.error(f"unknown option {key!r} in {origin}")
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                parser.error(f"{key!r} in {origin} is a switch: use true or false, not {value!r}")
            argv += [option] if value else []
        elif action.nargs in ("+", "*"):
            argv += [option, *(_token(v) for v in (value if isinstance(value, list) else [value]))]
        else:
            argv += [option, _token(value)]
    return argv


def _token(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Put the options of `--config FILE` before the command line, so the command line wins."""
    path = None
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif token.startswith("--config="):
            path = token.split("=", 1)[1]
    if path is None:
        return argv
    try:
        options = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"cannot read config file {path}: {exc}")
    if not isinstance(options, dict):
        parser.error(f"config file {path} must hold a mapping of option names to values")
    return options_to_argv(options, parser, f"config file {path}") + argv


def check_launch_args(args: argparse.Namespace, parser: LaunchArgumentParser) -> None:
    """Fail loudly on flags srv accepts but cannot honour, and on unavailable backends."""
    defaults = parser.defaults()
    for spec in load_flag_specs():
        value = getattr(args, spec.dest)
        if spec.deprecated and value:
            parser.error(f"{spec.name}: {spec.help}")
        # A family's documented default (SGLang's) is checked where a feature uses it, and stands
        # aside there for the best available backend if unavailable here; named, it must be here.
        if spec.family and value not in (None, AUTO) and not (spec.none and value == NONE) \
                and (value != spec.default or spec.dest in parser.given):
            try:
                parser.registry.choose(spec.family, value)
            except BackendError as exc:
                parser.error(f"{spec.name}: {exc}")
        if spec.name in NOT_SUPPORTED_YET and value != defaults[spec.dest]:
            parser.error(f"{spec.name} is not supported yet")
    for name in warmup_names(args):
        try:
            parser.registry.choose("warmup", name)
        except BackendError as exc:
            parser.error(f"--warmups: {exc}")
    if args.speculative_algorithm:
        for message in speculative_refusals(args):
            parser.error(message)
    for message in parallel_refusals(args):
        parser.error(message)
    for flag in ("--preferred-sampling-params", "--model-loader-extra-config"):
        text = getattr(args, flag.lstrip("-").replace("-", "_"))
        if text is None:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            parser.error(f"{flag} is not valid JSON: {exc}")
        if not isinstance(value, dict):
            parser.error(f"{flag} must be a JSON object")
    if args.forward_hooks is not None:
        from srv.engine.forward_hooks import check_forward_hooks

        try:
            check_forward_hooks(args.forward_hooks)
        except ValueError as exc:
            parser.error(str(exc))
    if args.numa_node:
        from srv.engine.layout import computing_processes
        from srv.engine.numa import check_numa_nodes

        try:
            check_numa_nodes(args.numa_node, computing_processes(args))
        except ValueError as exc:
            parser.error(str(exc))
    if args.delete_ckpt_after_loading:
        if not args.model_path:
            parser.error("--delete-ckpt-after-loading deletes --model-path's checkpoint: the embedded default "
                         "model is not deleted")
        if args.skip_server_warmup and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
            parser.error("--delete-ckpt-after-loading deletes the checkpoint after the warm-up, which every rank "
                         "takes part in: it cannot be combined with --skip-server-warmup under tp or pp > 1")
    if args.kv_events_config:
        try:
            config = json.loads(args.kv_events_config)
        except ValueError as exc:
            parser.error(f"--kv-events-config is not valid JSON: {exc}")
        if not isinstance(config, dict):
            parser.error("--kv-events-config must be a JSON object")
        try:
            parser.registry.choose("kv_events_publisher", config.get("publisher", "null"))
        except BackendError as exc:
            parser.error(f"--kv-events-config: {exc}")
        if args.disable_radix_cache:
            parser.error("--kv-events-config publishes the prefix cache's changes: it needs the prefix cache "
                         "(drop --disable-radix-cache)")
    if args.dynamic_batch_tokenizer_batch_timeout < 0:
        parser.error("--dynamic-batch-tokenizer-batch-timeout must be at least 0")
    for flag in ("--scheduler-recv-interval", "--num-continuous-decode-steps", "--dynamic-batch-tokenizer-batch-size"):
        if getattr(args, flag.lstrip("-").replace("-", "_")) < 1:
            parser.error(f"{flag} must be at least 1")
    if args.device not in (None, "cpu"):
        # --disable-cuda-graph and --disable-overlap-schedule are accepted as they are: srv runs
        # no CUDA graphs and no overlapped scheduling, so they describe what it does already.
        parser.error(f"--device {args.device}: srv runs on the CPU (--device cpu); GPU devices are not supported yet")
    if getattr(args, "torchao_config", "") and args.quantization not in (None, "torchao"):
        # torchao is a quantization method: one method serves a launch's weights.
        parser.error(f"--torchao-config quantizes the weights itself; it cannot be combined with "
                     f"--quantization {args.quantization}")


def parallel_refusals(args: argparse.Namespace) -> list[str]:
    """What srv cannot honour of the parallel and multi-node flags."""
    tp, pp, nnodes = args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes
    refused = []
    if tp < 1 or pp < 1 or nnodes < 1:
        refused.append("--tensor-parallel-size, --pipeline-parallel-size and --nnodes must be at least 1")
    elif (tp * pp) % nnodes:
        refused.append(f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} ranks do not split over "
                       f"--nnodes {nnodes}")
    if not 0 <= args.node_rank < max(nnodes, 1):
        refused.append(f"--node-rank {args.node_rank} is not one of the {nnodes} nodes")
    if args.data_parallel_size < 1:
        refused.append("--data-parallel-size must be at least 1")
    if args.data_parallel_size > 1 and nnodes > 1:
        refused.append("--data-parallel-size > 1 across --nnodes > 1 is not supported yet: each node runs its own "
                       "data-parallel groups behind its own server")
    if not args.load_watch_interval > 0:
        refused.append(f"--load-watch-interval {args.load_watch_interval}: the seconds between load calls must be "
                       "more than 0")
    if args.data_parallel_size > 1 and args.dist_init_addr:
        refused.append("--dist-init-addr with --data-parallel-size > 1: each group forms its tensor-parallel group "
                       "on a port of its own")
    if args.nccl_port is not None and not 0 < args.nccl_port < 65536:
        refused.append(f"--nccl-port {args.nccl_port} is not a port")
    if args.data_parallel_size > 1 and args.nccl_port and tp * pp > 1 and not args.enable_dp_attention:
        refused.append("--nccl-port with --data-parallel-size > 1: each group forms its tensor-parallel group on a "
                       "port of its own")
    if args.enable_dp_lm_head and not args.enable_dp_attention:
        refused.append("--enable-dp-lm-head needs --enable-dp-attention: it keeps the vocabulary head whole on each "
                       "data-parallel attention rank")
    if args.enable_dp_attention:
        if args.data_parallel_size < 2:
            refused.append("--enable-dp-attention needs --data-parallel-size > 1: each group is an attention rank")
        elif tp != args.data_parallel_size:
            refused.append(f"--enable-dp-attention with --tensor-parallel-size {tp} and --data-parallel-size "
                           f"{args.data_parallel_size}: srv runs attention whole on each rank, so the sizes must be "
                           "equal (split attention within a group is not supported yet)")
        if pp > 1 or nnodes > 1:
            refused.append("--enable-dp-attention with --pipeline-parallel-size or --nnodes > 1 is not supported yet")
        if args.enable_lora or args.lora_paths:
            # The feed-forward blocks run on all ranks' rows gathered: an adapter's rows would
            # have to travel with them.
            refused.append("--enable-lora with --enable-dp-attention is not supported yet")
    if nnodes > 1 and not args.dist_init_addr:
        refused.append("--nnodes > 1 needs --dist-init-addr HOST:PORT, where node 0's rank 0 forms the group")
    ep = args.expert_parallel_size
    if ep < 1 or tp % ep:
        refused.append(f"--ep-size {ep} must divide --tensor-parallel-size {tp}: each group of "
                       f"--tensor-parallel-size / --ep-size ranks holds a share of the experts")
    if not 0.0 <= args.eplb_min_rebalancing_utilization_threshold <= 1.0:
        refused.append(f"--eplb-min-rebalancing-utilization-threshold {args.eplb_min_rebalancing_utilization_threshold} "
                       "must be in [0.0, 1.0]")
    if args.eplb_rebalance_layers_per_chunk is not None and args.eplb_rebalance_layers_per_chunk < 1:
        refused.append("--eplb-rebalance-layers-per-chunk must be at least 1")
    if args.moe_dense_tp_size not in (None, 1):
        refused.append(f"--moe-dense-tp-size {args.moe_dense_tp_size}: only 1 (a MoE model's dense layers whole on "
                       "every rank) is supported, as in SGLang")
    if args.ep_dispatch_algorithm not in (None, "static"):
        refused.append(f"--ep-dispatch-algorithm {args.ep_dispatch_algorithm}: srv sends a route to a replicated "
                       "expert's copy by the token's row (static); dynamic dispatch is not supported yet")
    return refused


def warmup_names(args: argparse.Namespace) -> list[str]:
    """--warmups: the `warmup` family's names, comma-separated, in the order they run."""
    return [name.strip() for name in (args.warmups or "").split(",") if name.strip()]


def speculative_refusals(args: argparse.Namespace) -> list[str]:
    """What srv's speculative decoding cannot honour of the --speculative-* flags."""
    from srv.sdk.speculative import SpeculativeConfig

    refused = []
    try:
        SpeculativeConfig.from_args(args, 2)
    except ValueError as exc:
        refused.append(str(exc))
    for flag in ("single", "acc"):
        if getattr(args, f"speculative_accept_threshold_{flag}") != 1.0:
            refused.append(f"--speculative-accept-threshold-{flag}: not supported: srv accepts a draft by the exact "
                           "rule only (the output keeps the target's distribution)")
    return refused


def parse_launch_args(
    argv: Iterable[str], manager: PluginManager, registry: BackendRegistry
) -> argparse.Namespace:
    parser = build_launch_parser(manager, registry)
    args = parser.parse_args(expand_config_file(list(argv), parser))
    check_launch_args(args, parser)
    return args
