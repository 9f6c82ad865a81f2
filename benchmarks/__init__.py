"""`make bench`: srv against llama.cpp's llama-server and Hugging Face transformers on the default
model, written up in BENCHMARKS.md. Run with `python -m benchmarks` (see `--help`)."""
