"""Flags srv accepts but does not implement yet.

Setting one of these to anything but its default makes `srv launch` fail with
"--flag is not supported yet" instead of ignoring it. The list shrinks as features land;
tests/test_args.py holds a copy so every change to it is deliberate.
"""

NOT_SUPPORTED_YET = frozenset({
    # Model and tokenizer
    "--enable-multimodal",
    "--limit-mm-data-per-request",
    # HTTP server
    # Quantization and data type
    "--modelopt-quant",
    "--modelopt-checkpoint-restore-path",
    "--modelopt-checkpoint-save-path",
    # Memory and scheduling
    "--hybrid-kvcache-ratio",
    "--swa-full-tokens-ratio",
    "--disable-hybrid-swa-memory",
    # Runtime options
    "--elastic-ep-backend",
    "--mooncake-ib-device",
    "--base-gpu-id",
    "--gpu-id-step",
    "--mm-process-config",
    # Logging
    # Data parallelism
    "--prefill-round-robin-balance",
    # Multi-node distributed serving
    # Model override args
    # LoRA
    # Kernel backends (attention, sampling, grammar, GEMM)
    "--mm-attention-backend",
    "--nsa-prefill",
    "--nsa-decode",
    "--fp8-gemm-backend",
    "--disable-flashinfer-autotune",
    # MoE
    "--flashinfer-mxfp4-moe-precision",
    "--enable-flashinfer-allreduce-fusion",
    "--deepep-mode",
    "--deepep-config",
    # Mamba cache
    "--max-mamba-cache-size",
    "--mamba-ssm-dtype",
    "--mamba-full-memory-ratio",
    "--mamba-scheduler-strategy",
    "--mamba-track-interval",
    # LMCache
    "--enable-lmcache",
    # Double sparsity
    "--enable-double-sparsity",
    "--ds-channel-config-path",
    "--ds-heavy-channel-num",
    "--ds-heavy-token-num",
    "--ds-heavy-channel-type",
    "--ds-sparse-decode-threshold",
    # Offloading
    "--cpu-offload-gb",
    "--offload-group-size",
    "--offload-num-in-group",
    "--offload-prefetch-step",
    "--offload-mode",
    # Optimization/debug options
    "--cuda-graph-max-bs",
    "--cuda-graph-bs",
    "--disable-cuda-graph-padding",
    "--enable-profile-cuda-graph",
    "--enable-cudagraph-gc",
    "--enable-nccl-nvls",
    "--enable-symm-mem",
    "--disable-flashinfer-cutlass-moe-fp4-allgather",
    "--enable-mscclpp",
    "--enable-torch-symm-mem",
    "--enable-two-batch-overlap",
    "--enable-single-batch-overlap",
    "--tbo-token-distribution-threshold",
    "--enable-torch-compile",
    "--enable-torch-compile-debug-mode",
    "--enable-piecewise-cuda-graph",
    "--piecewise-cuda-graph-tokens",
    "--torch-compile-max-bs",
    "--piecewise-cuda-graph-max-tokens",
    "--enable-p2p-check",
    "--triton-attention-reduce-in-fp32",
    "--triton-attention-num-kv-splits",
    "--triton-attention-split-tile-size",
    "--enable-weights-cpu-backup",
    "--flashinfer-mla-disable-ragged",
    "--disable-shared-experts-fusion",
    "--disable-chunked-prefix-cache",
    "--disable-fast-image-processor",
    "--keep-mm-feature-on-device",
    "--enable-layerwise-nvtx-marker",
    "--enable-attn-tp-input-scattered",
    "--enable-nsa-prefill-context-parallel",
    # Forward hooks
    # Debug tensor dumps
    "--debug-tensor-dump-inject",
    # PD disaggregation
    "--disaggregation-mode",
    "--disaggregation-transfer-backend",
    "--disaggregation-bootstrap-port",
    "--disaggregation-decode-tp",
    "--disaggregation-decode-dp",
    "--disaggregation-prefill-pp",
    "--disaggregation-ib-device",
    "--disaggregation-decode-enable-offload-kvcache",
    "--num-reserved-decode-tokens",
    "--disaggregation-decode-polling-interval",
    # Custom weight loader
    "--custom-weight-loader",
    "--remote-instance-weight-loader-seed-instance-ip",
    "--remote-instance-weight-loader-seed-instance-service-port",
    "--remote-instance-weight-loader-send-weights-group-ports",
    # PD multiplexing
    "--enable-pdmux",
    "--pdmux-config-path",
    "--sm-group-num",
    # Deterministic inference
    "--enable-deterministic-inference",
})
